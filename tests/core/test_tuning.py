"""Tuned configs persist per GPU and Triton version: buckets, atomic files, damaged files, shipped defaults."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import tilegemm
from tilegemm.core import tuning
from tilegemm.cli import main
from tilegemm.ops.matmul import autotuned
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close

CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty tuning cache, with timing on (the call path times nothing unless asked: see the untimed tests)."""
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TILEGEMM_TUNE", "1")
    monkeypatch.setattr(tuning, "shipped_file", lambda: tmp_path / "shipped.json")
    tuning.forget()
    yield tmp_path
    tuning.forget()


def test_m_buckets():
    assert [tuning.m_bucket(m) for m in (1, 2, 3, 5, 16, 17, 100, 4096, 8192, 8193)] == \
        [1, 2, 4, 8, 16, 32, 128, 4096, 8192, 8193]
    assert tuning.key("autotuned", 3, 7, 9, torch.float16, torch.float32) == "autotuned|M4|N7|K9|fp16|fp32|"


def test_record_writes_atomically_and_survives_the_process(cache):
    k = tuning.key("autotuned", 20, 30, 40, torch.float16, torch.float16)
    tuning.record(k, CFG)
    files = list((cache / "cache").iterdir())
    assert [f.suffix for f in files] == [".json"], "no temporary file may be left behind"
    data = json.loads(files[0].read_text())
    assert data["schema"] == tuning.SCHEMA and data["entries"][k] == CFG
    tuning.forget()
    assert tuning.lookup(k) == CFG  # read back from disk
    assert tuning.lookup(tuning.key("autotuned", 31, 30, 40, torch.float16, torch.float16)) == CFG  # same bucket
    assert tuning.lookup(tuning.key("autotuned", 33, 30, 40, torch.float16, torch.float16)) is None


def test_a_batched_class_is_its_own_and_borrows_no_single_products_entry(cache):
    """A batched product's key adds its bucketed batch count; it is not parsed as a neighbour, so neither it nor
    a single product of its sizes takes the other's config untimed."""
    single = tuning.key("autotuned", 256, 4096, 4096, torch.float16, torch.float16, "NN")
    batched = tuning.key("autotuned", 256, 4096, 4096, torch.float16, torch.float16, "NN", batch=32)
    assert batched == single + "|B32" and tuning.key("autotuned", 9, 9, 9, torch.float16, torch.float16, "NN",
                                                     batch=20) .endswith("|B32")
    assert tuning.key("autotuned", 9, 9, 9, torch.float16, torch.float16, "NN", batch=1) == \
        tuning.key("autotuned", 9, 9, 9, torch.float16, torch.float16, "NN")
    assert tuning.parse_key(batched) is None and tuning.parse_key(single) is not None
    tuning.record(single, CFG)
    assert tuning.lookup(batched) is None
    assert tuning.nearest(batched, [CFG]) is None, "a batched class takes no single product's entry"
    assert tuning.choose_untimed(batched, [CFG, dict(CFG, BLOCK_M=128)], lambda options: options[1]) == \
        dict(CFG, BLOCK_M=128), "the rung's model decides"
    tuning.record(batched, dict(CFG, BLOCK_N=256))
    neighbour = tuning.key("autotuned", 300, 4096, 4096, torch.float16, torch.float16, "NN")
    assert tuning.nearest(neighbour, [CFG, dict(CFG, BLOCK_N=256)]) == CFG, "nor lends its own to one"


def test_a_batched_problem_keys_its_batch():
    from tilegemm.ops.matmul.problem import make_problems

    def problem(batch):
        lead = (batch,) if batch > 1 else ()
        a, b = torch.empty(*lead, 256, 512, dtype=torch.float16), torch.empty(*lead, 512, 384, dtype=torch.float16)
        out = torch.empty(*lead, 256, 384, dtype=torch.float16)
        return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]

    assert problem(1).tuning_key("autotuned") == "autotuned|M256|N384|K512|fp16|fp16|NN"
    assert problem(6).tuning_key("split_k") == "split_k|M256|N384|K512|fp16|fp16|NN|B8"


@pytest.mark.parametrize("damage", ["{ not json", '{"schema": "other/9", "entries": {}}', '["a list"]', ""])
def test_damaged_file_is_ignored_with_a_warning_and_rebuilt(cache, damage):
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    with pytest.warns(UserWarning, match="ignoring damaged tuning file"):
        assert tuning.lookup("autotuned|M1|N1|K1|fp16|fp16|") is None
    tuning.record("autotuned|M1|N1|K1|fp16|fp16|", CFG)
    assert json.loads(path.read_text())["entries"]["autotuned|M1|N1|K1|fp16|fp16|"] == CFG


def test_an_unwritable_cache_keeps_configs_in_memory_with_one_warning(cache, monkeypatch):
    # TILEGEMM_CACHE_DIR naming a file: the call that tuned keeps its config (it raised from the call before)
    blocker = cache / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(blocker))
    k = tuning.key("autotuned", 20, 30, 40, torch.float16, torch.float16)
    monkeypatch.setattr(tuning, "_unsaved_warned", False)
    with pytest.warns(UserWarning, match="cannot write the tuning cache .*kept in memory only"):
        tuning.record(k, CFG)
    assert tuning.lookup(k) == CFG
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        tuning.record(tuning.key("autotuned", 200, 30, 40, torch.float16, torch.float16), CFG)


def test_tune_refuses_an_unwritable_cache_before_tuning(cache, monkeypatch, capsys):
    blocker = cache / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(blocker))
    assert main(["tune", "--shape", "16,16,16", "--dtype", "fp16", "--kernels", "autotuned"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the tuning cache" in err and "it is a file, not a folder" in err


def test_shipped_defaults_are_used_and_user_entries_win(cache):
    k = tuning.key("persistent_tma", 8192, 8192, 8192, torch.float16, torch.float16, "NN")
    shipped = dict(CFG, BLOCK_M=128)
    (cache / "shipped.json").write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {k: shipped}}))
    assert tuning.lookup(k) == shipped
    tuning.record(k, CFG)
    tuning.forget()
    assert tuning.lookup(k) == CFG


def test_the_cache_file_holds_only_tuned_entries(cache):
    """Shipped entries stay out of the user's file, so a later release's shipped configs are not shadowed."""
    shipped_key = tuning.key("persistent_tma", 8192, 8192, 8192, torch.float16, torch.float16, "NN")
    (cache / "shipped.json").write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {shipped_key: CFG}}))
    k = tuning.key("autotuned", 20, 30, 40, torch.float16, torch.float16)
    assert tuning.lookup(shipped_key) == CFG
    tuning.record(k, CFG)
    data = json.loads(tuning.cache_file().read_text())
    assert data["tuned_only"] is True and list(data["entries"]) == [k]
    # A release that ships a new config for the key: the user gets it.
    newer = dict(CFG, BLOCK_M=128)
    (cache / "shipped.json").write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {shipped_key: newer}}))
    tuning.forget()
    assert tuning.lookup(shipped_key) == newer and tuning.lookup(k) == CFG


def test_an_older_cache_file_does_not_shadow_todays_shipped_entries(cache):
    """Files written before ``tuned_only`` held copies of the shipped entries of their day: those keys now
    come from the shipped file; the file's other (tuned) entries still count, and are kept on the next save."""
    shipped_key = tuning.key("persistent_tma", 4096, 4096, 4096, torch.float16, torch.float16, "NN")
    tuned_key = tuning.key("autotuned", 20, 30, 40, torch.float16, torch.float16)
    stale, today = dict(CFG, BLOCK_M=64), dict(CFG, BLOCK_M=128)
    (cache / "shipped.json").write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {shipped_key: today}}))
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {shipped_key: stale, tuned_key: CFG}}))
    assert tuning.lookup(shipped_key) == today
    assert tuning.lookup(tuned_key) == CFG
    tuning.record(tuning.key("autotuned", 1, 2, 3, torch.float16, torch.float16), CFG)
    data = json.loads(path.read_text())
    assert data["tuned_only"] is True and shipped_key not in data["entries"] and tuned_key in data["entries"]


def test_disk_can_be_turned_off(cache, monkeypatch):
    monkeypatch.setenv("TILEGEMM_TUNING_CACHE", "0")
    tuning.record("autotuned|M1|N2|K3|fp16|fp16|", CFG)
    assert not (cache / "cache").exists()
    assert tuning.lookup("autotuned|M1|N2|K3|fp16|fp16|") == CFG  # memory still works


def test_autotuned_launches_the_stored_config(cache, monkeypatch, device):
    a = torch.randn(20, 48, dtype=torch.float16, device=device)
    b = torch.randn(48, 40, dtype=torch.float16, device=device)
    tuning.record(tuning.key("autotuned", 20, 40, 48, torch.float16, torch.float16, "NN"), CFG)
    used = []
    real_launch = autotuned.launch
    monkeypatch.setattr(autotuned, "launch", lambda k, g, args, kw: used.append(kw) or real_launch(k, g, args, kw))
    out = tilegemm.matmul(a, b, kernel="autotuned")
    assert used and all(used[0][name] == value for name, value in CFG.items())
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def test_layout_and_tf32_are_part_of_the_key(cache, device):
    a = torch.randn(20, 48, device=device)
    b = torch.randn(40, 48, device=device).T
    tilegemm.matmul(a, b, kernel="autotuned", precision="tf32")
    tilegemm.matmul(a, b, kernel="autotuned", precision="ieee")
    keys = set(tuning.entries())
    assert "autotuned|M32|N40|K48|tf32|fp32|NT" in keys
    assert "autotuned|M32|N40|K48|fp32|fp32|NT" in keys


def test_autotuned_times_afresh_for_each_key(cache, device, monkeypatch):
    """Triton's autotuner keys its winners by M, N, K and dtypes only; a winner timed for tf32 must not be
    taken (and recorded) for IEEE fp32 of the same sizes, nor one for NN for NT."""
    kernel = autotuned.matmul_autotuned_kernel
    real_run = kernel.run
    remembered = []
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: remembered.append(len(kernel.cache)) or real_run(*a, **kw))
    a = torch.randn(20, 48, device=device)
    b = torch.randn(40, 48, device=device)
    for bt, precision in ((b.T, "tf32"), (b.T, "ieee"), (b.T.contiguous(), "ieee")):
        # (Under the interpreter there is one candidate, which Triton does not remember: stand one in.)
        kernel.cache[(32, 40, 48, "torch.float32")] = kernel.configs[0]
        tilegemm.matmul(a, bt, kernel="autotuned", precision=precision)
    assert remembered == [0, 0, 0], "each new key starts with nothing remembered"


def test_tune_command(cache, capsys):
    assert main(["tune", "--shape", "24,40,56", "--rungs", "autotuned,persistent_tma"]) == 0
    out = capsys.readouterr().out
    assert "autotuned|M32|N40|K56" in out and "persistent_tma|M32|N40|K56" in out
    saved = json.loads(tuning.cache_file().read_text())["entries"]
    assert "autotuned|M32|N40|K56|fp16|fp16|NN" in saved
    assert main(["tune", "--rungs", "naive"]) == 2
    assert "--kernels takes auto, autotuned, persistent_tma, split_k" in capsys.readouterr().err


def test_lookup_or_tune_times_once_and_keeps_the_fastest(cache, monkeypatch):
    import triton.testing

    speed = {1: 3.0, 2: 1.0, 3: float("nan")}  # candidate 3 "fails": it raises below
    launched = []

    def fake_do_bench(fn, **kwargs):
        assert kwargs.get("return_mode") == "median"
        fn()
        if launched[-1] == 3:
            raise RuntimeError("does not compile")
        return speed[launched[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    k = tuning.key("demo", 16, 64, 4096, torch.float16, torch.float16)  # a rung whose entries have no set fields
    options = lambda: [dict(id=1), dict(id=2), dict(id=3)]  # noqa: E731
    assert tuning.lookup_or_tune(k, options, lambda cfg: launched.append(cfg["id"])) == dict(id=2)
    assert launched == [1, 2, 3]
    # Known now: nothing is timed again, in this process or (from the file) in the next.
    assert tuning.lookup_or_tune(k, options, lambda cfg: launched.append(cfg["id"])) == dict(id=2)
    tuning.forget()
    assert tuning.lookup_or_tune(k, options, lambda cfg: launched.append(cfg["id"])) == dict(id=2)
    assert launched == [1, 2, 3]
    # A single candidate is taken without timing.
    k1 = tuning.key("demo", 1, 8, 8, torch.float16, torch.float16)
    assert tuning.lookup_or_tune(k1, lambda: [dict(id=9)], lambda cfg: launched.append(cfg["id"])) == dict(id=9)
    assert launched == [1, 2, 3]


def test_timed_launches_are_replays_of_the_candidates_own(monkeypatch):
    """do_bench's first call launches (compiles, may tune), the second is recorded, the rest replay it."""
    import tilegemm.core.launch as launch_mod

    launched, replayed = [], []

    class FakeRecording:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.launches = [launch_mod.Launch(compiled=None, grid=(1, 1, 1), params=["w", 3])]
            return False

    class FakeReplay:
        def __init__(self, recorded, tensors):
            assert recorded.params == ["w", 3] and tensors == ()  # no tensor parameters in this fake
            self.ok = True

        def __call__(self, *tensors):
            replayed.append(tensors)
            return self.ok

    monkeypatch.setattr(launch_mod, "recording", FakeRecording)
    monkeypatch.setattr(launch_mod, "Replay", FakeReplay)
    run = tuning.replaying(lambda cfg: launched.append(cfg["id"]), dict(id=7))
    for _ in range(5):
        run()
    assert launched == [7, 7] and len(replayed) == 3

    # A replay that declines (another stream) makes every later call launch afresh.
    run = tuning.replaying(lambda cfg: launched.append(cfg["id"]), dict(id=8))
    run(), run()
    monkeypatch.setattr(FakeReplay, "__call__", lambda self, *t: replayed.append(t) or False)
    run(), run()
    assert launched[-4:] == [8, 8, 8, 8] and len(replayed) == 4


def test_tuner_replays_launches_with_host_descriptors(monkeypatch):
    """A launch whose operands are host-side TMA descriptors (Gluon's or Triton's) is replayed like any
    other: the tuner's replay takes each descriptor's base as the call's tensor (it used to find no tensor
    for them, and then launched every timed call through Triton's slow path)."""
    import tilegemm.core.launch as launch_mod
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, out = torch.randn(64, 32), torch.empty(64, 64)
    desc = TensorDescriptor(a, [64, 32], [32, 1], [64, 32])
    assert launch_mod.call_tensors([desc, out, 3, 0.5]) == (a, out)

    class FakeRecording:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.launches = [launch_mod.Launch(compiled=None, grid=(1, 1, 1), params=[desc, out, 3])]
            return False

    made = []

    class FakeReplay:
        def __init__(self, recorded, tensors):
            made.append(tensors)

        def __call__(self, *tensors):
            return True

    monkeypatch.setattr(launch_mod, "recording", FakeRecording)
    monkeypatch.setattr(launch_mod, "Replay", FakeReplay)
    launched = []
    run = tuning.replaying(lambda cfg: launched.append(1), {})
    for _ in range(5):
        run()
    assert launched == [1, 1] and len(made) == 1
    assert made[0][0] is a and made[0][1] is out


def test_unreplayable_launches_are_launched_every_time(monkeypatch):
    import tilegemm.core.launch as launch_mod

    class Spoiled:  # what recording gives under the interpreter
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.launches = None
            return False

    monkeypatch.setattr(launch_mod, "recording", Spoiled)
    launched = []
    run = tuning.replaying(lambda cfg: launched.append(cfg["id"]), dict(id=1))
    for _ in range(4):
        run()
    assert launched == [1, 1, 1, 1]


def test_lookup_or_tune_retimes_near_ties_longer(cache, monkeypatch):
    """The short first pass only finds the field: candidates within 10% of its best are timed again."""
    import triton.testing

    first = {1: 1.00, 2: 1.05, 3: 1.08, 4: 1.09, 5: 2.0}  # the short pass: 1 looks fastest, 4 is fourth
    longer = {1: 1.20, 2: 1.00, 3: 1.10}  # longer timing: 2 is
    timed = []

    def fake_do_bench(fn, **kwargs):
        fn()
        timed.append((launched[-1], kwargs["rep"]))
        return (first if kwargs["rep"] == 20 else longer)[launched[-1]]

    launched = []
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    k = tuning.key("split_k", 16, 64, 4096, torch.float16, torch.float16)
    got = tuning.lookup_or_tune(k, lambda: [dict(id=i) for i in range(1, 6)], lambda cfg: launched.append(cfg["id"]))
    assert got == dict(id=2)
    assert [i for i, rep in timed if rep == 20] == [1, 2, 3, 4, 5]
    # The three best of the first pass (4 is within 10% but fourth), two alternating rounds each.
    assert [i for i, rep in timed if rep != 20] == [1, 2, 3, 1, 2, 3]


def test_auto_times_split_k_against_persistent_tma_once_per_shape_class(cache, monkeypatch):
    """M in (16, 128] on a TMA GPU: auto times both rungs (each tuned first) and remembers the winner."""
    import triton.testing

    from tilegemm.ops.matmul import dispatch, persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)
    calls = []
    monkeypatch.setattr(dispatch, "launcher", lambda name: lambda p: calls.append(name))
    speed = {"split_k": 2.0, "persistent_tma": 1.0}

    def fake_do_bench(fn, **kwargs):
        fn()  # like do_bench: one untimed launch first (where a rung tunes itself), then the timed ones
        fn()
        return speed[calls[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)

    def problem(M, N=4096, K=1024):
        a, b = torch.empty(M, K, device="meta"), torch.empty(K, N, device="meta")
        return make_problems(a, b, torch.empty(M, N, device="meta"), None, None, 1.0, 1.0, "none", "ieee",
                             False)[0]

    assert dispatch.choose_kernel(problem(100)) == "persistent_tma"
    # Each rung ran once untimed (its own tuning happens there), then once in the timing.
    assert calls == ["split_k", "split_k", "persistent_tma", "persistent_tma"]
    key = tuning.key("auto", 100, 4096, 1024, "fp32", torch.float32, "NN")
    assert tuning.lookup(key) == {"rung": "persistent_tma"}
    # Same bucket (M 65..128): no timing again. M <= 16 goes to split_k without timing, and so does a
    # problem too small for its rung to matter next to the host's launch (64 x 64 x 64).
    assert dispatch.choose_kernel(problem(120)) == "persistent_tma"
    assert dispatch.choose_kernel(problem(16)) == "split_k"
    assert dispatch.choose_kernel(problem(64, 64, 64)) == "split_k"
    assert dispatch.choose_kernel(problem(64, 512, 256)) == "split_k"  # under dispatch.TIMED_MIN_MNK
    assert len(calls) == 4
    # Where TMA cannot go, split_k without timing.
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: "not 16-byte aligned")
    assert dispatch.choose_kernel(problem(40)) == "split_k"
    assert len(calls) == 4


def test_untimed_small_m_rung_comes_from_a_near_tuned_class_else_split_k(cache, monkeypatch):
    """Timing off: an M <= 128 problem that TMA can describe takes the rung of a tuned shape class within
    dispatch.UNTIMED_RUNG_DISTANCE, else split_k (a far class, e.g. 2048^3's persistent_tma, once ran
    24x128x20968 tf32 in a single unsplit tile at 0.05x cuBLAS)."""
    from tilegemm.ops.matmul import dispatch, persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)
    monkeypatch.setattr(dispatch, "launcher", lambda name: pytest.fail("untimed: nothing is launched"))

    def problem(M, N, K):
        a, b = torch.empty(M, K, device="meta"), torch.empty(K, N, device="meta")
        return make_problems(a, b, torch.empty(M, N, device="meta"), None, None, 1.0, 1.0, "none", "tf32",
                             False)[0]

    tuning.record(tuning.key("auto", 2048, 2048, 2048, "tf32", torch.float32, "NN"), {"rung": "persistent_tma"})
    assert dispatch.choose_kernel(problem(24, 128, 20968)) == "split_k"
    tuning.record(tuning.key("auto", 100, 4096, 1024, "tf32", torch.float32, "NN"), {"rung": "persistent_tma"})
    assert dispatch.choose_kernel(problem(110, 4096, 2048)) == "persistent_tma"  # distance 1 from M100 N4096 K1024


def test_auto_timed_choice_skips_a_rung_that_fails(cache, monkeypatch):
    """A rung that raises while being timed (e.g. does not compile) is not chosen, and the call goes on."""
    import triton.testing

    from tilegemm.ops.matmul import dispatch, persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)

    def launch(name):
        def run(p):
            if name == "persistent_tma":
                raise RuntimeError("out of resource: shared memory")
        return run

    monkeypatch.setattr(dispatch, "launcher", launch)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)
    a, b = torch.empty(100, 1024, device="meta"), torch.empty(1024, 4096, device="meta")
    p = make_problems(a, b, torch.empty(100, 4096, device="meta"), None, None, 1.0, 1.0, "none", "ieee", False)[0]
    assert dispatch.choose_kernel(p) == "split_k"


@pytest.mark.parametrize("gluon", [False, True], ids=["no-gluon", "gluon-tf32"])
@pytest.mark.parametrize("precision,layout", [("ieee", "NN"), ("tf32", "NN"), ("tf32", "TT"), ("tf32", "NT")])
def test_auto_sends_large_problems_to_persistent_tma_unless_an_operand_goes_through_registers(
        monkeypatch, precision, layout, gluon):
    """From two 128x128 tiles per SM up, auto takes persistent_tma on a TMA GPU, except tf32 with an operand
    through registers: that rung's Triton loops for it must stay flattened (serialized) to be right, so
    autotuned is faster, unless the Gluon tf32 kernel takes the problem (NN or TT, sm_90); from
    one to two tiles per SM auto then times the two rungs, below it keeps autotuned."""
    import tilegemm.core.hardware
    from tilegemm.ops.matmul import gluon_tf32, dispatch, persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "gluon_kernel_for",
                        lambda p: gluon_tf32 if gluon and gluon_tf32.why_not(p) is None else None)
    timed = []
    monkeypatch.setattr(dispatch, "_timed_choice", lambda p, rungs, **kw: timed.append(rungs) or rungs[-1])

    def problem(M, N, K=256):
        a = torch.empty(K, M, device="meta").mT if layout[0] == "T" else torch.empty(M, K, device="meta")
        b = torch.empty(N, K, device="meta").mT if layout[1] == "T" else torch.empty(K, N, device="meta")
        return make_problems(a, b, torch.empty(M, N, device="meta"), None, None, 1.0, 0.0, "none", precision,
                             False)[0]

    big = problem(4096, 4096)
    expected_operands = {"ieee": "ab", "tf32": {"NN": "swap", "TT": "reg_a", "NT": "ab"}[layout]}[precision]
    assert big.mma_operands == expected_operands
    takes_gluon = gluon and precision == "tf32" and layout in ("NN", "TT")
    expected = "persistent_tma" if expected_operands == "ab" or takes_gluon else "autotuned"
    assert dispatch.choose_kernel(big) == expected
    assert not timed
    # 2048^3: 256 tiles, under two per SM: autotuned, or (Gluon tf32) a timed choice between the two rungs.
    assert dispatch.choose_kernel(problem(2048, 2048)) == ("persistent_tma" if takes_gluon else "autotuned")
    assert timed == ([("autotuned", "persistent_tma")] if takes_gluon else [])
    # 1024^3: 64 tiles, under half a tile per SM: autotuned.
    assert dispatch.choose_kernel(problem(1024, 1024)) == "autotuned"
    assert len(timed) == (1 if takes_gluon else 0)


@pytest.mark.parametrize("gluon", [False, True], ids=["no-gluon", "gluon-fp8"])
def test_auto_times_the_rungs_for_promoted_fp8_from_half_a_tile_per_sm(monkeypatch, gluon):
    """Promoted fp8 that gluon_fp8 takes: persistent_tma from two 128x128 tiles per SM, a timed choice from
    half a tile to two (2048^3), autotuned below. Without it (fast accumulation, another layout) Triton's
    persistent kernel still needs four tiles per SM."""
    import tilegemm.core.hardware
    from tilegemm.ops.matmul import gluon_fp8, dispatch, persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "gluon_kernel_for", lambda p: gluon_fp8 if gluon else None)
    timed = []
    monkeypatch.setattr(dispatch, "_timed_choice", lambda p, rungs, **kw: timed.append(rungs) or rungs[-1])

    def problem(M, N, K=256):
        a = torch.empty(M, K, device="meta", dtype=torch.float8_e4m3fn)
        b = torch.empty(N, K, device="meta", dtype=torch.float8_e4m3fn).mT
        out = torch.empty(M, N, device="meta", dtype=torch.bfloat16)
        return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]

    assert dispatch.choose_kernel(problem(4096, 4096)) == "persistent_tma"  # 1024 tiles: either way
    assert dispatch.choose_kernel(problem(2816, 2816)) == ("persistent_tma" if gluon else "autotuned")  # 484 < 4 * 132
    assert not timed
    assert dispatch.choose_kernel(problem(2048, 2048)) == ("persistent_tma" if gluon else "autotuned")
    assert timed == ([("autotuned", "persistent_tma")] if gluon else [])
    assert dispatch.choose_kernel(problem(1024, 1024)) == "autotuned"  # 64 tiles
    assert len(timed) == (1 if gluon else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", ["persistent_tma", "autotuned", "split_k"])
def test_timed_replays_compute_the_candidates_product_on_the_gpu(rung):
    """The tuner's replays launch the candidate's kernels on the same tensors: poisoned between calls, the
    output is whole again after a replayed call (and the replays were made: a third call launches nothing
    through the launcher)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.problem import make_problems

    M, N = 96, 136
    K = 4096 if rung == "split_k" else 520
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    launched = []
    rung_launcher = dispatch.launcher(rung)
    run = tuning.replaying(lambda cfg: launched.append(1) or rung_launcher(p), {})
    run(), run()
    assert len(launched) == 2
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    assert len(launched) == 2, "the third call was not a replay"
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


# --- no timing on the call path unless asked -----------------------------------------------------------------


def test_untimed_calls_take_the_nearest_tuned_shape_class(cache, monkeypatch):
    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    a, b, c = dict(id=1), dict(id=2), dict(id=3)
    tuning.record("split_k|M16|N4096|K4096|fp16|fp16|NN", a)
    tuning.record("split_k|M16|N28672|K8192|fp16|fp16|NN", b)
    tuning.record("split_k|M16|N4096|K4096|bf16|bf16|NN", c)  # another dtype: never a neighbour
    launched = []
    got = tuning.lookup_or_tune("split_k|M16|N5000|K4000|fp16|fp16|NN", lambda: [a, b, c],
                                lambda cfg: launched.append(cfg))
    assert got == a and launched == [], "nothing is timed; the nearest class (N4096, K4096) wins"
    assert tuning.lookup_or_tune("split_k|M16|N30000|K8000|fp16|fp16|NN", lambda: [a, b, c], None) == b
    # A neighbour whose config this problem cannot use (not among its candidates) is passed over.
    assert tuning.lookup_or_tune("split_k|M16|N4100|K4100|fp16|fp16|NN", lambda: [b, c], None) == b
    # Nothing near: the fallback, then the first candidate.
    assert tuning.lookup_or_tune("split_k|M16|N64|K64|fp32|fp32|NN", lambda: [c, b], None, lambda o: o[1]) == b
    assert tuning.lookup_or_tune("split_k|M16|N64|K64|tf32|fp32|NN", lambda: [c, b], None) == c
    # The untimed choice is remembered for the process but not written as tuned.
    assert "split_k|M16|N5000|K4000|fp16|fp16|NN" not in json.loads(tuning.cache_file().read_text())["entries"]


def test_timing_context_turns_timing_on(cache, monkeypatch):
    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    assert not tuning.timing_enabled()
    with tuning.timing():
        assert tuning.timing_enabled()
    assert not tuning.timing_enabled()


def test_version_one_files_are_read_with_todays_dtype_names(cache):
    old = {"schema": "tilegemm-tuned/1", "gpu": "x", "triton": "3.6.0", "entries": {
        "autotuned|M16|N64|K64|float16|float16|NN": CFG,
        "persistent_tma|M16|N64|K64|float8_e4m3fnxfloat8_e5m2+fast|bfloat16|NT": {"BLOCK_M": 32, "num_warps": 4}}}
    (cache / "shipped.json").write_text(json.dumps(old))
    tuning.forget()
    assert tuning.lookup("autotuned|M16|N64|K64|fp16|fp16|NN") == CFG
    fp8 = "persistent_tma|M16|N64|K64|fp8_e4m3xfp8_e5m2+fast|bf16|NT"
    assert tuning.lookup(fp8) == {"BLOCK_M": 32, "num_warps": 4}


def test_shipped_files_use_one_dtype_vocabulary():
    import pathlib

    import tilegemm

    names = {"fp16", "bf16", "fp32", "tf32", "fp8_e4m3", "fp8_e5m2"}
    for path in (pathlib.Path(tilegemm.__file__).parent / "tuned").glob("*.json"):
        data = json.loads(path.read_text())
        assert data["schema"] == tuning.SCHEMA
        for k in data["entries"]:
            dtype, out = k.split("|")[4:6]
            assert set(dtype.split("+")[0].split("x")) <= names and out in names, k


@pytest.mark.parametrize("slug", ["nvidia-h200", "nvidia-h100-80gb-hbm3"])
def test_the_shipped_table_is_found_for_each_gpu_it_names(slug, monkeypatch):
    monkeypatch.setattr(tuning, "_device_tag", lambda: (slug, "3.6.0"))
    monkeypatch.setenv("TILEGEMM_TUNING_CACHE", "0")
    tuning.forget()
    try:
        assert tuning.shipped_file().exists(), tuning.shipped_file()
        assert len(tuning.entries()) > 50, "the shipped entries should load"
    finally:
        tuning.forget()


def test_auto_sends_small_m_problems_to_split_k_aligned_or_not(monkeypatch):
    """Since the wrapped-tile hint fix, split_k ran misaligned small-M rows ahead of autotuned on all nine
    such shapes measured (7x340x10945: 1.00x cuBLAS against 0.17x; H200, results/2026-11-23-h200/4e789c1/)."""
    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: False)

    def problem(M, N, K):
        a, b = torch.empty(M, K, device="meta", dtype=torch.float16), torch.empty(K, N, device="meta", dtype=torch.float16)
        return make_problems(a, b, torch.empty(M, N, device="meta", dtype=torch.float16), None, None, 1.0, 1.0,
                             "none", "ieee", False)[0]

    assert dispatch.choose_kernel(problem(5, 423, 2047)) == "split_k"
    assert dispatch.choose_kernel(problem(2, 3792, 19287)) == "split_k"  # A's rows 19287 elements apart
    assert dispatch.choose_kernel(problem(8, 424, 2048)) == "split_k"


def test_warmup_calls_each_known_shape_class_once(cache, monkeypatch):
    """``tilegemm warmup``'s matmul entry: every entry of a registered kernel is called on its shape class
    (dtype, out dtype, layout, fp8 scales and fast accumulation as the key says); auto and odd layouts skipped."""
    from tilegemm.ops.matmul import tune

    for key in ("autotuned|M16|N24|K40|fp16|fp16|NT", "split_k|M8|N16|K32|fp32|fp32|TN",
                "grouped|M4|N16|K32|tf32|fp32|NN", "naive|M4|N16|K32|fp8_e5m2xfp8_e4m3+fast|bf16|NT",
                "auto|M16|N24|K40|fp16|fp16|NN", "autotuned|M16|N24|K40|fp16|fp16|SN"):
        tuning.record(key, {})
    calls = []
    real = tilegemm.matmul

    def spy(a, b, **kw):
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, a.stride(1) == 1, b.stride(1) == 1, kw))
        return real(a, b, **{k: v for k, v in kw.items() if k != "kernel"}, kernel="grouped")

    monkeypatch.setattr("tilegemm.ops.matmul.api.matmul", spy)
    warmed = tune.warmup()
    assert warmed == ["autotuned|M16|N24|K40|fp16|fp16|NT", "grouped|M4|N16|K32|tf32|fp32|NN",
                      "naive|M4|N16|K32|fp8_e5m2xfp8_e4m3+fast|bf16|NT", "split_k|M8|N16|K32|fp32|fp32|TN"]
    by_kernel = {c[6]["kernel"]: c for c in calls}
    assert by_kernel["autotuned"][:6] == ((16, 40), (40, 24), torch.float16, torch.float16, True, False)
    assert by_kernel["split_k"][4:6] == (False, True) and by_kernel["split_k"][6]["precision"] == "ieee"
    assert by_kernel["grouped"][6]["precision"] == "tf32"
    fp8 = by_kernel["naive"]
    assert fp8[2:4] == (torch.float8_e5m2, torch.float8_e4m3fn) and fp8[6]["fast_accum"] is True
    assert fp8[6]["out_dtype"] == torch.bfloat16


def test_warmup_command_under_the_interpreter_compiles_nothing(capsys):
    from tilegemm.cli import main

    if not tilegemm.interpreting():
        pytest.skip("the interpreter's behaviour (on a GPU, warmup compiles the shipped classes)")
    assert main(["warmup"]) == 0
    assert "nothing to warm up" in capsys.readouterr().out
    assert main(["warmup", "--op", "copy"]) == 2
    assert main(["warmup", "--shape", "7,9,11", "--dtype", "bf16"]) == 0
    assert "nothing to warm up" in capsys.readouterr().out
    assert main(["warmup", "--dtype", "bf16"]) == 2, "--dtype without --shape"
    assert "--dtype applies with --shape only" in capsys.readouterr().err
    assert main(["warmup", "--shape", "7,9"]) == 2
    assert "malformed matmul shape" in capsys.readouterr().err
    assert main(["warmup", "--shape", "7,9,11", "--dtype", "fp5"]) == 2


def test_warmup_of_given_shapes_calls_auto_once_on_each(monkeypatch):
    """``tilegemm warmup --shape``: auto on exactly those shapes, in the dtype asked (fp8 with its scales)."""
    from tilegemm.ops.matmul import tune
    from tilegemm.ops.matmul.bench import MatmulBench

    calls = []
    real = tilegemm.matmul

    def spy(a, b, **kw):
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype, kw.get("kernel"), "scale_a" in kw))
        return real(a.float(), b.float(), kernel="grouped")

    monkeypatch.setattr("tilegemm.matmul", spy)
    cases = [MatmulBench().parse_shape(t) for t in ("5,7,9", "16x24x40")]
    assert tune.warmup(cases=cases, dtype="fp32") == ["auto|5x7x9|fp32", "auto|16x24x40|fp32"]
    assert calls == [((5, 9), (9, 7), torch.float32, "auto", False), ((16, 40), (40, 24), torch.float32, "auto", False)]
    calls.clear()
    seen = []
    assert tune.warmup(on_key=seen.append, cases=cases[:1], dtype="fp8_e4m3") == ["auto|5x7x9|fp8_e4m3"]
    assert seen == ["auto|5x7x9|fp8_e4m3"] and calls[0][2] == torch.float8_e4m3fn and calls[0][4]


def test_untimed_guesses_are_neither_neighbours_nor_in_the_way_of_timing(cache, monkeypatch):
    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    a, b = dict(id=1), dict(id=2)
    # Nothing known: the fallback's guess for one class must not become the neighbour of the next.
    assert tuning.lookup_or_tune("split_k|M16|N64|K64|fp32|fp32|NN", lambda: [a, b], None, lambda o: o[1]) == b
    assert tuning.lookup_or_tune("split_k|M16|N80|K64|fp32|fp32|NN", lambda: [a, b], None, lambda o: o[0]) == a
    assert "split_k|M16|N64|K64|fp32|fp32|NN" not in tuning.entries()
    # Asked to time later in the same process, the guessed class is timed and recorded.
    import triton.testing

    monkeypatch.setenv("TILEGEMM_TUNE", "1")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: fn() or 1.0)
    launched = []
    got = tuning.lookup_or_tune("split_k|M16|N64|K64|fp32|fp32|NN", lambda: [a, b], lambda cfg: launched.append(cfg))
    assert launched and tuning.lookup("split_k|M16|N64|K64|fp32|fp32|NN") == got


def test_untimed_guesses_keep_variants_of_one_key_apart(cache, monkeypatch):
    """Aligned and misaligned rows of one key (TN: A's row stride is M, which the key buckets) are priced apart
    by the cost model, so each keeps its own guess; the same variant is answered from memory."""
    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    a, b = dict(id=1), dict(id=2)
    k = "autotuned|M1024|N512|K512|fp16|fp16|TN"
    asked = []

    def pick(choice):
        return lambda options: asked.append(choice) or options[choice]

    assert tuning.choose_untimed(k, [a, b], pick(0), variant=True) == a
    assert tuning.choose_untimed(k, [a, b], pick(1), variant=False) == b, "the misaligned problem's own guess"
    assert tuning.choose_untimed(k, [a, b], pick(1), variant=True) == a and asked == [0, 1], "remembered"


def test_an_entry_tuned_before_a_config_key_existed_still_matches_its_candidate(cache, monkeypatch):
    monkeypatch.setenv("TILEGEMM_TUNE", "0")
    old = dict(BLOCK_M=64, num_warps=4)  # tuned before HOST_DESC existed
    tuning.record("persistent_tma|M1024|N1024|K1024|fp16|fp16|NN", old)
    options = [dict(BLOCK_M=128, num_warps=8, HOST_DESC=True), dict(BLOCK_M=64, num_warps=4, HOST_DESC=True)]
    assert tuning.nearest("persistent_tma|M1024|N1100|K1024|fp16|fp16|NN", options) == old


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"), ("NVIDIA H200 NVL", "nvidia-h200"), ("NVIDIA GH200 480GB", "nvidia-h200"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("NVIDIA H100 PCIe", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA H100 NVL", "nvidia-h100-80gb-hbm3"), ("NVIDIA H800", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"), ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "nvidia-h100-80gb-hbm3-mig-1g-10gb"),  # a slice: the rules
    ("NVIDIA H200 MIG 1g.18gb", "nvidia-h200-mig-1g-18gb"), ("NVIDIA H20", "nvidia-h20"),
    ("NVIDIA GB200", "nvidia-gb200"), ("NVIDIA B200", "nvidia-b200"),
])
def test_a_gpu_without_tables_takes_a_shipped_siblings_or_none(name, slug):
    """Hopper GPUs the package ships nothing for read their sibling's tables; other architectures keep their own
    slug, which names no file (the rules decide there)."""
    assert tuning.table_slug(name) == slug
    assert tuning.table_slug(tuning.gpu_slug(name)) == slug, "a slug resolves as its name does"
    assert tuning.ships_tables_for(slug) == (slug in ("nvidia-h200", "nvidia-h100-80gb-hbm3"))


def test_a_sibling_gpu_loads_the_siblings_shipped_entries_and_survey_table(monkeypatch):
    from tilegemm.ops.matmul import survey

    monkeypatch.setattr(tuning, "_device_tag", lambda: ("nvidia-h100-pcie", "3.6.0"))
    monkeypatch.setenv("TILEGEMM_TUNING_CACHE", "0")
    tuning.forget()
    try:
        assert tuning.shipped_file().name == "nvidia-h100-80gb-hbm3.json"
        assert len(tuning.entries()) > 50, "the sibling's shipped entries should load"
        assert tuning.cache_file().name.startswith("tuned-nvidia-h100-pcie-"), "what a user tunes stays their GPU's"
    finally:
        tuning.forget()
    assert survey.table_path("NVIDIA H100 PCIe") == survey.table_path("NVIDIA H100 80GB HBM3")
    assert survey.table_path("NVIDIA H200 NVL", "NT") == survey.table_path("NVIDIA H200", "NT")
    monkeypatch.setattr(survey, "_tables", {})
    assert survey.table_for("NVIDIA H800") is not None
    assert survey.table_for("NVIDIA A100-SXM4-80GB") is None
    own = survey.table_path("NVIDIA H100 PCIe", "NT", "fp8", own=True)
    assert own.name == "nvidia-h100-pcie-fp8-NT.json", "a survey of this GPU is written under its own name"


def test_a_siblings_entries_do_not_stand_in_for_this_gpus_while_timing(monkeypatch):
    """``tilegemm tune`` on a GPU that reads a sibling's shipped entries times their classes: while timing is
    on those entries count as unknown; the GPU's own shipped entries still stand."""
    monkeypatch.setenv("TILEGEMM_TUNING_CACHE", "0")
    for slug, borrowed in (("nvidia-h100-pcie", True), ("nvidia-h100-80gb-hbm3", False)):
        monkeypatch.setattr(tuning, "_device_tag", lambda slug=slug: (slug, "3.6.0"))
        tuning.forget()
        try:
            k = next(iter(sorted(tuning.entries())))
            assert tuning.lookup(k) is not None
            with tuning.timing():
                assert (tuning.lookup(k) is None) == borrowed
            assert tuning.lookup(k) is not None
        finally:
            tuning.forget()


def test_untimed_choices_are_forgotten_past_their_bound(monkeypatch):
    # a server's varying shapes made one entry each, kept for the life of the process
    from tilegemm.core import tuning as t

    monkeypatch.setattr(t, "_guessed", {})
    monkeypatch.setattr(t, "GUESSED_MAX", 3)
    monkeypatch.setattr(t, "nearest", lambda *a, **k: None)  # no tuned table's neighbour (a GPU's has some)
    for n in range(7):
        got = t.choose_untimed(t.key("split_k", 16, 1000 + n, 4096, "fp16", torch.float16, "NN", 1),
                               [{"BLOCK_M": 16, "n": n}])
        assert got == {"BLOCK_M": 16, "n": n}
        assert 1 <= len(t._guessed) <= 3


def test_processes_saving_side_by_side_keep_each_others_entries(cache):
    # another process (here: its file written directly) saved entries after this one read the file: this
    # process's save reads them again under the folder's lock and keeps them
    mine, theirs = (tuning.key("autotuned", m, 64, 64, torch.float16, torch.float16) for m in (16, 512))
    assert tuning.lookup(mine) is None  # (this process has read the file: none yet)
    path = tuning.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA, "tuned_only": True, "entries": {theirs: CFG}}))
    tuning.record(mine, dict(CFG, BLOCK_M=32))
    entries = json.loads(path.read_text())["entries"]
    assert entries == {mine: dict(CFG, BLOCK_M=32), theirs: CFG}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no lock or temporary file left


@pytest.mark.parametrize("bad", [{}, {"BLOCK_SIZE_M": 64, "num_warps": 4}, dict(CFG, BLOCK_M="64"),
                                 dict(CFG, BLOCK_M=48), dict(CFG, BLOCK_K=32.0), dict(CFG, num_warps=0),
                                 [["BLOCK_M", 64]]])
def test_entries_no_kernel_can_take_are_ignored_with_a_warning(cache, bad, device):
    # a file from an older version (renamed fields), edited by hand or damaged in part: its bad entries are
    # passed over, so the call chooses as for an unknown class instead of failing in the kernel every time
    a = torch.randn(16, 32, dtype=torch.float16, device=device)
    b = torch.randn(32, 16, dtype=torch.float16, device=device)
    k = tuning.key("autotuned", 16, 16, 32, torch.float16, torch.float16, "NN")
    good = tuning.key("autotuned", 64, 64, 64, torch.float16, torch.float16, "NN")
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA, "tuned_only": True, "entries": {k: bad, good: CFG}}))
    with pytest.warns(UserWarning, match="1 entry of the tuning file .* is not a config this version reads"):
        assert tuning.lookup(k) is None
    assert tuning.lookup(good) == CFG
    out = tilegemm.matmul(a, b, kernel="autotuned")
    torch.testing.assert_close(out.float(), (a.float() @ b.float()), rtol=2e-3, atol=2e-3)


def test_a_newer_versions_file_is_left_as_it_is(cache):
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    newer = json.dumps({"schema": "tilegemm-tuned/9", "entries": {"autotuned|M1|N1|K1|fp16|fp16|": {"X": 1}}})
    path.write_text(newer)
    with pytest.warns(UserWarning, match="schema 'tilegemm-tuned/9'.*left as it is"):
        tuning.record("autotuned|M2|N2|K2|fp16|fp16|", CFG)
    assert path.read_text() == newer
    assert tuning.lookup("autotuned|M2|N2|K2|fp16|fp16|") == CFG  # kept in memory


def test_an_unreadable_file_is_not_written_over(cache, monkeypatch):
    import pathlib

    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {}}))
    real = pathlib.Path.read_text

    def read_text(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    with pytest.warns(UserWarning, match="cannot read the tuning file .*Permission denied.*left as it is"):
        tuning.record("autotuned|M2|N2|K2|fp16|fp16|", CFG)
    monkeypatch.setattr(pathlib.Path, "read_text", real)
    assert json.loads(path.read_text())["entries"] == {}


def test_no_home_directory_keeps_tunings_in_memory(cache, monkeypatch):
    import pathlib

    from tilegemm.core import runtime

    monkeypatch.delenv("TILEGEMM_CACHE_DIR")
    monkeypatch.setattr(pathlib.Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(
        RuntimeError("Could not determine home directory."))))
    monkeypatch.setattr(runtime, "interpreting", lambda: False)  # (the interpreter keeps no files unless asked)
    monkeypatch.setattr(tuning, "_device_tag", lambda: ("gpu", "3.6.0"))
    monkeypatch.setattr(tuning, "_no_home_warned", False)
    with pytest.raises(RuntimeError, match="set TILEGEMM_CACHE_DIR"):
        tuning.cache_dir()
    with pytest.warns(UserWarning, match="no home directory.*in memory only"):
        tuning.record("autotuned|M2|N2|K2|fp16|fp16|", CFG)
    assert tuning.lookup("autotuned|M2|N2|K2|fp16|fp16|") == CFG


def test_the_cache_folder_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TILEGEMM_CACHE_DIR", "~/tuning")
    assert tuning.cache_dir() == tmp_path / "tuning"


def test_yes_no_variables_warn_on_other_values(monkeypatch):
    monkeypatch.setattr(tuning, "_warned_env", set())
    for value, want in (("1", True), ("ON", True), ("no", False), ("", False)):
        monkeypatch.setenv("TILEGEMM_TUNE", value)
        assert tuning.timing_enabled() is want
    monkeypatch.setenv("TILEGEMM_TUNE", "2")
    with pytest.warns(UserWarning, match="TILEGEMM_TUNE='2' is not one of 1, true"):
        assert tuning.timing_enabled() is False
    monkeypatch.setenv("TILEGEMM_TUNING_CACHE", "maybe")
    with pytest.warns(UserWarning, match="TILEGEMM_TUNING_CACHE='maybe'.*taken as on"):
        tuning.env_flag("TILEGEMM_TUNING_CACHE", True)


def test_threads_autotuning_at_once_record_their_own_winners(cache, monkeypatch):
    # one Triton autotuner serves every shape: a thread read the winner another thread's autotune had just set and
    # recorded it under its own key
    import threading
    import types

    from tilegemm.ops.matmul import autotuned
    from tilegemm.ops.matmul.problem import make_problems

    other_done = threading.Event()

    class Autotuner:  # sets its winner for the thread that runs it; "A" reads it only after "B" ran (if B can)
        cache: dict = {}
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                me = threading.current_thread().name
                self.best_config = types.SimpleNamespace(
                    kwargs=dict(BLOCK_M=64 if me == "A" else 128, BLOCK_N=32, BLOCK_K=16, GROUP_M=8),
                    num_warps=4, num_stages=1)
                if me == "A":
                    other_done.wait(2)
                else:
                    other_done.set()
            return run

    monkeypatch.setattr(autotuned, "matmul_autotuned_kernel", Autotuner())

    def call(K):
        a, b = torch.randn(200, K), torch.randn(K, 200)
        (p,) = make_problems(a, b, torch.empty(200, 200), precision="ieee")
        with tuning.timing():
            autotuned.run(p)
        return p.tuning_key("autotuned")

    keys = {}
    threads = [threading.Thread(target=lambda n=n, K=K: keys.__setitem__(n, call(K)), name=n)
               for n, K in (("A", 64), ("B", 128))]
    threads[0].start()
    import time

    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join()
    assert tuning.lookup(keys["A"])["BLOCK_M"] == 64 and tuning.lookup(keys["B"])["BLOCK_M"] == 128


def test_a_file_of_bytes_that_are_no_text_is_damage(cache):
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"schema": "tilegemm-tuned/2", "entries": {}}\xff\xfe')
    with pytest.warns(UserWarning, match="ignoring damaged tuning file"):
        assert tuning.lookup("autotuned|M1|N1|K1|fp16|fp16|") is None
    tuning.record("autotuned|M1|N1|K1|fp16|fp16|", CFG)
    assert json.loads(path.read_text())["entries"] == {"autotuned|M1|N1|K1|fp16|fp16|": CFG}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_child_forked_during_a_save_does_not_keep_the_folder_locked(cache):
    # flock belongs to the open descriptor, which a forked child inherits: kept there, the parent's next save
    # waited for the child to exit
    import threading

    tuning.record("autotuned|M1|N1|K1|fp16|fp16|", CFG)
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with tuning._folder_lock(tuning.cache_file().parent):
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(30)
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        leave.set()
        t.join()
        saved = threading.Thread(target=tuning.record, args=("autotuned|M2|N2|K2|fp16|fp16|", CFG))
        saved.start()
        saved.join(3)
        assert not saved.is_alive(), "the save waited for the child"
    finally:
        os.waitpid(pid, 0)
