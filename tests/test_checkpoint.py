"""Our checkpoint format (round trip, atomicity, every load error) and the reference's v4/v2 reader."""

import io
import json
import struct
import zipfile

import numpy as np
import pytest

from anectypes.formats import checkpoint
from anectypes.formats.checkpoint import check_compatible, load_checkpoint, save_checkpoint
from anectypes.formats.reference import read_reference_checkpoint
from anectypes.errors import CheckpointError
from anectypes.model.config import ADDED_FIELDS, ModelConfig, param_shapes
from support.checkpoints import odd_members, reference_file, write_odd

# tiny GQA model: q_dim 16, kv_dim 8
CFG = ModelConfig(dim=16, hidden=24, heads=4, kv_heads=2, head_dim=4, layers=2, seq=8, vocab=10)


def _tensors(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(CFG).items()}


def _save(path, state=None, t=7):
    params, m, v = _tensors(0), _tensors(1), {k: a * a for k, a in _tensors(2).items()}
    save_checkpoint(path, CFG.to_dict(), params, {"t": t, "m": m, "v": v}, state or {"step": 1})
    return params, m, v


def _rewrite(path, meta=None, drop=(), arrays=None):
    """Copy the checkpoint zip at `path` onto itself with meta.json replaced, members dropped or arrays set."""
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if n not in drop}
    if meta is not None:
        members["meta.json"] = json.dumps(meta).encode()
    for name, a in (arrays or {}).items():
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=True)
        members[name] = buf.getvalue()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _meta(path):
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("meta.json"))


def _load_error(path):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(1234)
    rng.random(5)
    state = {"step": 300, "best_loss": float("inf"), "lr": 0.1, "tiny": 5e-324, "big": 2**100 + 1,
             "loss_scaler": {"scale": 256.0, "clean": 17}, "history": [1, 2.5, None, True, "x"],
             "sampler_rng": rng.bit_generator.state, "loss32": np.float32(0.3)}
    path = tmp_path / "ckpt.npz"
    params, m, v = _save(path, state, t=300)
    ck = load_checkpoint(path)
    assert ck.config == CFG.to_dict() and ck.optimizer["t"] == 300
    for got, want in ((ck.params, params), (ck.optimizer["m"], m), (ck.optimizer["v"], v)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == np.float32 and got[k].tobytes() == want[k].tobytes()
    assert ck.state == {**state, "loss32": float(np.float32(0.3))}  # numpy scalars come back as Python numbers
    assert type(ck.state["big"]) is int and ck.state["lr"] == 0.1
    restored = np.random.default_rng()
    restored.bit_generator.state = ck.state["sampler_rng"]
    np.testing.assert_array_equal(restored.random(4), rng.random(4))
    # an uncompressed .npz that numpy and unzip can read directly
    with zipfile.ZipFile(path) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    np.testing.assert_array_equal(np.load(path)["param/embed"], params["embed"])
    assert _meta(path)["format"] == "anectypes-checkpoint" and _meta(path)["version"] == 1


def test_failed_save_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    _save(path, {"step": 1})
    before = path.read_bytes()
    calls, real = [], np.lib.format.write_array

    def crash_midway(*args, **kwargs):  # a few tensors are written, then the "disk" fails
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        _save(path, {"step": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before and load_checkpoint(path).state == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]


def test_save_refuses_bad_tensors_and_non_json_state(tmp_path):
    path = tmp_path / "ckpt.npz"
    params, m, v = _save(path)
    before = path.read_bytes()
    params["layers.0.w1"][3, 4] = np.nan
    with pytest.raises(CheckpointError, match=r"not saving .*param/layers.0.w1 contains NaN or inf"):
        save_checkpoint(path, CFG.to_dict(), params, {"t": 1, "m": m, "v": v}, {})
    params["layers.0.w1"][3, 4] = 0
    with pytest.raises(CheckpointError, match=r"adam_m/embed is missing"):
        save_checkpoint(path, CFG.to_dict(), params, {"t": 1, "m": {k: a for k, a in m.items() if k != "embed"},
                                                       "v": v}, {})
    with pytest.raises(CheckpointError, match="state is not JSON"):
        save_checkpoint(path, CFG.to_dict(), params, {"t": 1, "m": m, "v": v}, {"when": object()})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]


def test_missing_truncated_and_foreign_files(tmp_path):
    assert "no such checkpoint file" in _load_error(tmp_path / "nope.npz")
    path = tmp_path / "ckpt.npz"
    _save(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert "truncated or damaged" in _load_error(path)
    path.write_bytes(b"\x00" * 100)
    assert "truncated or damaged" in _load_error(path)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")
    assert "no meta.json" in _load_error(path)


def test_bad_meta(tmp_path):
    path = tmp_path / "ckpt.npz"
    _save(path)
    good = _meta(path)
    _rewrite(path, meta={**good, "format": "llama2c"})
    assert "format is 'llama2c', not 'anectypes-checkpoint'" in _load_error(path)
    _rewrite(path, meta={**good, "version": 2})
    assert "version 2 is not supported" in _load_error(path)
    _rewrite(path, meta={**good, "config": {**good["config"], "flavour": 1}})
    assert "meta.json's config has an unknown field 'flavour'" in _load_error(path)


def test_missing_wrong_shape_nan_and_pickled_tensors(tmp_path):
    path = tmp_path / "ckpt.npz"
    _save(path)
    good = _meta(path)
    _rewrite(path, drop=["param/layers.1.w2.npy"])
    assert "param/layers.1.w2 is missing" in _load_error(path)
    _save(path)
    _rewrite(path, meta={**good, "config": {**good["config"], "dim": 32}})  # wq is [q_dim, dim]: q_dim stays 16
    assert "is float32 [16, 16] but the model config needs float32 [16, 32]" in _load_error(path)
    _save(path)
    _rewrite(path, arrays={"adam_v/layers.0.wk.npy": np.zeros((8, 15), np.float32)})
    msg = _load_error(path)
    assert "adam_v/layers.0.wk is float32 [8, 15] but the model config needs float32 [8, 16]" in msg
    _save(path)
    _rewrite(path, arrays={"param/rms_final.npy": np.full(16, np.inf, np.float32)})
    assert "param/rms_final contains NaN or inf" in _load_error(path)
    _save(path)
    _rewrite(path, arrays={"param/embed.npy": np.full((10, 16), {"evil": 1}, dtype=object)})  # needs pickle
    assert "param/embed is object [10, 16] but the model config needs float32 [10, 16]" in _load_error(path)


def test_odd_metadata_and_tensors_are_one_line_saying_what_is_wrong(tmp_path):
    good = tmp_path / "good.ckpt"
    _save(good)
    for case, (members, phrase) in odd_members(_meta(good)).items():
        path = tmp_path / f"{case}.ckpt"
        write_odd(good, path, members)
        msg = _load_error(path)
        assert phrase in msg and len(msg) < 400, (case, msg)


def test_a_transposed_view_is_saved_in_c_order_and_a_fortran_order_tensor_reads_back(tmp_path):
    """A frozen weight held as a transposed view of its surface (fp32 LoRA) is written row-major; a checkpoint whose
    tensors are in Fortran order (as the fp32 LoRA runs of 2026-12-07 wrote them) reads back, equal, row-major."""
    params, m, v = _tensors(0), _tensors(1), _tensors(2)
    name = next(k for k, a in params.items() if a.ndim == 2 and a.shape[0] != a.shape[1])
    want = params[name].copy()
    params[name] = np.ascontiguousarray(want.T).T                  # a transposed view, as a surface holds it
    assert params[name].flags.f_contiguous and not params[name].flags.c_contiguous
    path = tmp_path / "views.ckpt"
    save_checkpoint(path, CFG.to_dict(), params, {"t": 7, "m": m, "v": {k: a * a for k, a in v.items()}}, {"step": 1})
    assert not np.load(path)[f"param/{name}"].flags.f_contiguous      # numpy's own reader: written in C order
    _rewrite(path, arrays={f"param/{name}.npy": np.asfortranarray(want)})
    got = load_checkpoint(path).params[name]
    assert got.flags.c_contiguous and np.array_equal(got, want)


def test_check_compatible():
    ck = checkpoint.Checkpoint(config=CFG.to_dict(), params={}, optimizer={}, state={})
    check_compatible(ck, CFG.to_dict())
    check_compatible(ck, CFG)
    other = {**CFG.to_dict(), "dim": 32, "layers": 4}
    with pytest.raises(CheckpointError) as e:
        check_compatible(ck, other)
    assert str(e.value).startswith("checkpoint was saved for dim=16, layers=2 "
                                   "but the run uses dim=32, layers=4;")


# --- the reference's file, built by hand from docs/ane-reference.md §4.8 ---

def _check_tensors(ref, want):
    got = {**{f"param/{k}": a for k, a in ref.params.items()}, **{f"m/{k}": a for k, a in ref.m.items()},
           **{f"v/{k}": a for k, a in ref.v.items()}}
    assert got.keys() == want.keys()
    for k, a in want.items():
        assert got[k].dtype == np.float32 and got[k].shape == a.shape, k
        np.testing.assert_array_equal(got[k], a, err_msg=k)


def test_reference_v4_with_gqa(tmp_path):
    path = tmp_path / "ane_ckpt.bin"
    want = reference_file(path)
    ref = read_reference_checkpoint(path)
    assert ref.config == CFG
    assert (ref.version, ref.step, ref.total_steps, ref.adam_t, ref.cum_steps, ref.cum_batches) == \
        (4, 250, 1000, 250, 250, 4000)
    assert ref.lr == float(np.float32(3e-4)) and ref.loss == 2.75
    assert (ref.cum_compile, ref.cum_train, ref.cum_wall) == (1.5, 20.25, 30.0)
    _check_tensors(ref, want)
    # layer 1's Wv is tensor number 29: after layer 0's 9 weights and 18 moments, and layer 1's wq, wk
    wv = np.frombuffer(path.read_bytes(), "<f4", offset=96)[sum(a.size for a in list(want.values())[:29]):]
    np.testing.assert_array_equal(ref.params["layers.1.wv"], wv[:8 * 16].reshape(8, 16))
    assert ref.params["layers.1.wv"][0, 0] == 29000
    # it converts to our format as is
    save_checkpoint(tmp_path / "ours.npz", ref.config.to_dict(), ref.params, ref.optimizer, {"step": ref.step})
    ours = load_checkpoint(tmp_path / "ours.npz")
    np.testing.assert_array_equal(ours.optimizer["v"]["embed"], want["v/embed"])


def test_reference_v2_is_full_mha(tmp_path):
    path = tmp_path / "static.bin"
    want = reference_file(path, version=2, kv_heads=4)
    ref = read_reference_checkpoint(path)
    assert ref.version == 2 and (ref.config.kv_heads, ref.config.head_dim) == (4, 4)
    assert ref.params["layers.0.wk"].shape == (16, 16)
    _check_tensors(ref, want)


def test_reference_errors(tmp_path):
    path = tmp_path / "ane_ckpt.bin"
    reference_file(path, magic=0x12345678)
    with pytest.raises(CheckpointError, match="magic 0x12345678 is not the reference's 0x424C5A54"):
        read_reference_checkpoint(path)
    reference_file(path, version=3)
    with pytest.raises(CheckpointError, match="version 3 is not supported"):
        read_reference_checkpoint(path)
    reference_file(path, head_dim=0)
    with pytest.raises(CheckpointError, match="impossible dimensions .*head_dim=0"):
        read_reference_checkpoint(path)
    reference_file(path)
    full = path.read_bytes()
    path.write_bytes(full[:-4])
    with pytest.raises(CheckpointError, match=f"file is {len(full) - 4} bytes but .* needs {len(full)};"):
        read_reference_checkpoint(path)
    path.write_bytes(full[:50])
    with pytest.raises(CheckpointError, match="shorter than the 96-byte reference header"):
        read_reference_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_reference_checkpoint(tmp_path / "nope.bin")
    path.write_bytes(full[:16] + struct.pack("<i", 10**9) + full[20:])      # n_layers 10^9: refused, not enumerated
    with pytest.raises(CheckpointError, match=f"{len(full)} bytes cannot hold the header's 1000000000 layers"):
        read_reference_checkpoint(path)


def test_checkpoint_saved_before_the_architecture_fields_loads_with_their_defaults(tmp_path):
    path = tmp_path / "old.ckpt"
    params, _, _ = _save(path)
    old = _meta(path)
    _rewrite(path, meta={**old, "config": {k: v for k, v in old["config"].items() if k not in ADDED_FIELDS}})
    ckpt = load_checkpoint(path)
    assert ckpt.config == CFG.to_dict() and ModelConfig(**ckpt.config).alpha == 0.5
    np.testing.assert_array_equal(ckpt.params["layers.1.wq"], params["layers.1.wq"])


def test_qk_norm_and_untied_classifier_round_trip_and_count(tmp_path):
    cfg = ModelConfig(**{**CFG.to_dict(), "qk_norm": True, "tied": False, "residual_scaled": False,
                         "rope_type": "llama3", "rope_factor": 4.0, "rope_original_context": 4})
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}
    assert params["layers.1.q_norm"].shape == (4,) and params["classifier"].shape == (10, 16)
    assert cfg.n_params() == sum(a.size for a in params.values()) == CFG.n_params() + 2 * 2 * 4 + 10 * 16
    assert cfg.training_bytes() > CFG.training_bytes() + 4 * 5 * (2 * 2 * 4 + 10 * 16)
    zero = {k: np.zeros_like(a) for k, a in params.items()}
    save_checkpoint(tmp_path / "c.ckpt", cfg.to_dict(), params, {"t": 1, "m": zero, "v": zero}, {"step": 1})
    ckpt = load_checkpoint(tmp_path / "c.ckpt")
    assert ModelConfig(**ckpt.config) == cfg and cfg.alpha == 1.0
    for k in ("layers.0.k_norm", "classifier"):
        np.testing.assert_array_equal(ckpt.params[k], params[k])
        assert k in ckpt.optimizer["m"]
