"""How the plugin fills a rank's parameters (weightd_vllm.core), with numpy "models" and a real daemon.

A fake model has vLLM 0.33's parameters (the fixture recorded from vLLM) as
zeroed numpy arrays. core.serve attaches the rank's set through the binding
(host backend) and fills them; every parameter must then hold exactly the
bytes tests/python/layout_ref.py computes from the checkpoint files for that
output. The tiers and the fallback decision are checked the same way: what
goes to the model's load_weights, what to the default loader, what is warned.
"""
import numpy as np
import pytest

import layout_ref
import weightd
from conftest import vllm_fixture
from weightd_vllm import checkpoint, core, names
from weightd_vllm.core import Spec
from weightd_vllm.ranks import Unservable

FIXTURE = vllm_fixture()
RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
WIDTH = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4}


def raw(a):
    """The bytes of an array, whatever numpy type the binding gave it (ml_dtypes, raw integers)."""
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


class FakeModel:
    """A core.Target over numpy arrays with vLLM's parameter names, shapes and dtypes.

    ``loads``: what its load_weights received (name, bytes); ``fills``: which
    parameters its load_weights claims, by a function of the names fed;
    ``events``: the order of copy/sync/release-relevant calls.
    """

    def __init__(self, params, daemon=None, shareable=()):
        self.specs = {n: Spec(tuple(s), d) for n, (s, d) in params.items()}
        self.arrays = {n: np.zeros(s, dtype=RAW[WIDTH[d]]) for n, (s, d) in params.items()}
        self.shared = {}
        self.shareable = set(shareable)
        self.loads = []
        self.default_fed = []
        self.default_loaded = 0
        self.events = []
        self.daemon = daemon
        self.leases_at_sync = []
        self.fills = lambda fed: None

    def params(self):
        return dict(self.specs)

    def copy(self, name, src):
        dst = self.arrays[name]
        dst.view(np.uint8).reshape(-1)[:] = np.frombuffer(raw(src), dtype=np.uint8)
        self.events.append("copy")

    def share(self, name, src):
        if name not in self.shareable:
            return False
        self.shared[name] = src
        return True

    def exempt(self, name):
        return name.endswith("k_scale")

    def packed(self):
        return {}

    def load_weights(self, weights):
        fed = [(n, raw(t)) for n, t in weights]
        self.loads.append(fed)
        return self.fills([n for n, _ in fed])

    def default_weights(self):
        for n in sorted(self._checkpoint.tensors):
            self.default_fed.append(n)
            yield n, self._checkpoint.array(n)

    def default_load(self):
        self.default_loaded += 1

    def sync(self):
        self.events.append("sync")
        if self.daemon is not None:
            self.leases_at_sync.append(self.daemon.status()["daemon"]["leases"])


def _case(name):
    return FIXTURE["cases"][name]


def _expected(models, case):
    """{vLLM parameter: bytes} that layout_ref computes from the files for the case's plan."""
    c = _case(case)
    ck = layout_ref.Checkpoint(models[c["model"]])
    outs = layout_ref.build(ck, **c["plan"])
    return ck, {names.to_vllm(n): layout_ref.materialize(ck, o) for n, o in outs.items()}


COPY_CASES = ["qwen3/w1r0", "qwen3_tied/w1r0", "qwen3_moe/w1r0", "deepseek_v3/w1r0", "tp2_qwen3/w2r1",
              "tp2_mqa/w2r1", "tp2_moe/w2r0", "tp2_moe_ep/w2r1", "tp2_deepseek_v2_ep/w2r0",
              "tp2_deepseek_v3_ep_rr/w2r1", "deepseek_v3_fp8/w1r0", "tp2_deepseek_v3_fp8/w2r1",
              "tp2_deepseek_v3_fp8_ep/w2r0"]


@pytest.mark.parametrize("case", COPY_CASES)
def test_copy_fills_every_parameter_with_the_files_bytes(client, daemon, models, case):
    c = _case(case)
    model = FakeModel(c["params"], daemon=daemon)
    rep = core.serve(model, client, models[c["model"]], c["plan"])
    _, want = _expected(models, case)
    assert sorted(rep.copied) == sorted(c["params"]) and rep.via_load_weights == rep.via_default == []
    for n, a in model.arrays.items():
        assert a.tobytes() == want[n], n
    assert rep.bytes_copied == sum(len(want[n]) for n in c["params"])
    # The copies were waited for while the lease was still held, then the set was released.
    assert model.events[-1] == "sync" and model.leases_at_sync == [1]
    assert daemon.status()["daemon"]["leases"] == 0
    assert rep.warnings == [] and rep.set_id


def test_a_shape_that_does_not_match_goes_to_load_weights(client, daemon, models):
    """Tier 2: the parameter's checkpoint tensors, whole from weightd, into the model's load_weights."""
    c = _case("tp2_moe_ep/w2r1")
    params = dict(c["params"])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    params[qkv] = [[7, 256], "BF16"]  # a layout weightd does not produce (say, a quantised packing)
    model = FakeModel(params, daemon=daemon)
    model.fills = lambda fed: {qkv} if any("q_proj" in n for n in fed) else set()
    hidden = core.assign

    def assign(p, outputs, to_output=names.to_weightd):  # w13 absent from the set: another way to be left over
        return hidden(p, {k: v for k, v in outputs.items() if k != names.to_weightd(w13)}, to_output)

    core.assign = assign
    try:
        path = models[c["model"]]
        ck = layout_ref.Checkpoint(path)
        model._checkpoint = ck
        warned = []
        rep = core.serve(model, client, path, c["plan"], warn=warned.append)
    finally:
        core.assign = hidden
    # One load_weights call, fed the whole source tensors of both, straight from the files' bytes.
    assert len(model.loads) == 2  # tier 2, then the default loader for w13 (fills() claimed only qkv)
    fed = dict(model.loads[0])
    want = set(names.checkpoint_sources(qkv, ck.tensors)) | set(names.checkpoint_sources(w13, ck.tensors))
    assert set(fed) == want and len(want) == 3 + 16
    for n, b in fed.items():
        assert b == bytes(ck.raw(n)), n
    assert rep.via_load_weights == [qkv]
    # w13 was not claimed by load_weights: named in the one warning, loaded by the default loader,
    # which is fed every checkpoint tensor except those the served parameters consumed.
    assert rep.via_default == [w13] and len(warned) == 1 and w13 in warned[0]
    consumed = {n for p in rep.copied + rep.via_load_weights for n in names.checkpoint_sources(p, ck.tensors)}
    assert [n for n, _ in model.loads[1]] == sorted(set(ck.tensors) - consumed)
    assert set(names.checkpoint_sources(w13, ck.tensors)) <= {n for n, _ in model.loads[1]}
    assert daemon.status()["daemon"]["leases"] == 0


def test_parameters_without_sources_are_warned_once_and_left_to_the_default_loader(client, models):
    c = _case("qwen3/w1r0")
    params = dict(c["params"])
    params["model.layers.0.mlp.extra.weight"] = [[4, 4], "BF16"]
    params["model.layers.0.self_attn.attn.k_scale"] = [[1], "F32"]  # exempt: no checkpoint has it
    model = FakeModel(params)
    model._checkpoint = layout_ref.Checkpoint(models["qwen3"])
    warned = []
    rep = core.serve(model, client, models["qwen3"], c["plan"], warn=warned.append)
    assert rep.via_default == ["model.layers.0.mlp.extra.weight"] and rep.exempt == [
        "model.layers.0.self_attn.attn.k_scale"]
    assert len(warned) == 1 and "model.layers.0.mlp.extra.weight" in warned[0] and "no tensor" in warned[0]
    assert model.loads and model.loads[-1] == []  # every checkpoint tensor was consumed by a copy
    with pytest.raises(core.NotServed, match="extra.weight.*fallback is off"):
        core.serve(FakeModel(params), client, models["qwen3"], c["plan"], fallback=False)


def test_shared_mode_shares_what_the_target_allows(client, daemon, models):
    c = _case("qwen3/w1r0")
    norms = [n for n in c["params"] if "norm" in n]
    model = FakeModel(c["params"], shareable=norms)
    rep = core.serve(model, client, models["qwen3"], c["plan"], mode="shared")
    assert sorted(rep.shared) == sorted(norms) and sorted(rep.copied + rep.shared) == sorted(c["params"])
    _, want = _expected(models, "qwen3/w1r0")
    for n in norms:
        assert raw(model.shared[n]) == want[n]
    # The shared arrays hold the set's lease (the binding's rule); it ends when they die.
    assert daemon.status()["daemon"]["leases"] == 1
    model.shared.clear()
    assert daemon.status()["daemon"]["leases"] == 0


def test_keep_resident_false_evicts_the_set(client, daemon, models):
    c = _case("qwen3/w1r0")
    rep = core.serve(FakeModel(c["params"]), client, models["qwen3"], c["plan"])
    assert rep.set_id in {s["set"] for s in daemon.status()["sets"]}
    rep = core.serve(FakeModel(c["params"]), client, models["qwen3"], c["plan"], keep_resident=False)
    assert rep.set_id not in {s["set"] for s in daemon.status()["sets"]}


def test_a_set_held_elsewhere_is_not_evicted(client, daemon, models):
    c = _case("qwen3/w1r0")
    with weightd.Client(daemon.socket) as other, other.attach(models["qwen3"], plan=c["plan"]) as held:
        rep = core.serve(FakeModel(c["params"]), client, models["qwen3"], c["plan"], keep_resident=False)
        assert rep.set_id == held.id and held.id in {s["set"] for s in daemon.status()["sets"]}


class _Whole(FakeModel):
    pass


@pytest.mark.parametrize("exc", [Unservable("pipeline parallelism (pp 2)"),
                                 weightd.ConnectError("cannot connect to /x.sock"),
                                 weightd.BadPlanError("heads do not divide by 3"),
                                 weightd.LibraryNotFound("libweightd.so: not found")])
def test_weightd_unavailable_means_the_default_loader_and_one_warning(exc):
    model = FakeModel({"a.weight": [[2], "BF16"], "b.weight": [[2], "BF16"]})

    def serve_rank():
        raise exc

    warned = []
    rep = core.load(model, serve_rank, warn=warned.append)
    assert model.default_loaded == 1 and len(warned) == 1
    assert "every parameter" in warned[0] and str(exc).split(":")[0] in warned[0]
    assert rep.fallback_reason and rep.via_default == ["a.weight", "b.weight"] and rep.copied == []
    with pytest.raises(core.NotServed, match="fallback is off"):
        core.load(FakeModel({}), serve_rank, fallback=False, warn=warned.append)
    assert len(warned) == 1


def test_bugs_are_not_fallbacks():
    def serve_rank():
        raise KeyError("a bug")

    model = FakeModel({})
    with pytest.raises(KeyError):
        core.load(model, serve_rank)
    assert model.default_loaded == 0


def test_assign_reasons():
    params = {"a": Spec((2, 3), "BF16"), "b": Spec((2, 3), "BF16"), "c": Spec((4,), "F16"), "d": Spec((4,), "I32"),
              "e": Spec((1,), "BF16")}
    outputs = {"a": Spec((2, 3), "BF16"), "b": Spec((3, 2), "BF16"), "c": Spec((4,), "F32"), "d": Spec((4,), "F32"),
               "z": Spec((1,), "BF16")}
    a = core.assign(params, outputs, to_output=lambda n: n)
    assert a.copies == [("a", "a"), ("c", "c")]  # F32 -> F16 converts as vLLM's copy_ does
    assert a.unserved == {"b": "shape [2, 3], the set's b is [3, 2]", "d": "dtype I32, the set's d is F32",
                          "e": "not in the set"}
    assert a.unused == ["b", "d", "z"]


def test_whole_plan_is_served_byte_for_byte(client, models):
    table = checkpoint.tensor_table(models["deepseek_v2"])
    ck = layout_ref.Checkpoint(models["deepseek_v2"])
    assert table == {n: (t.dtype, t.shape) for n, t in ck.tensors.items()}
    pick = sorted(table)[::7]
    with client.attach(models["deepseek_v2"], plan=checkpoint.whole_plan(pick, table)) as s:
        assert sorted(s.names()) == pick
        for n in pick:
            assert raw(s[n]) == bytes(ck.raw(n))


def test_urls_are_the_daemons_to_fetch():
    """A checkpoint named by URL is passed to the daemon as it is; nothing here tries to read its files."""
    for url in ("s3://bucket/models/qwen3", "S3://bucket/x", "https://host.example/ckpt", "http://h:8080/m"):
        assert checkpoint.is_url(url), url
    for path in ("/models/qwen3", "models/s3:/x", "s3:/bucket", "file:///models/x", ""):
        assert not checkpoint.is_url(path), path
    with pytest.raises(FileNotFoundError) as e:
        checkpoint.tensor_table("s3://bucket/models/qwen3")
    assert "no local files" in str(e.value)
