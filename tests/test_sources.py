"""One table for the model-source resolver (anectypes.sources): every kind of source, given to every
command that takes one (generate, export, train --init-from through the resolver call it makes, bench
generate, the dashboard's export and generation for a run), gives the same answer: the same weights,
config, classifier, vocabulary and tokenizer, known from how each source was written, or the same
one-line error (the source named as it was given)."""


import numpy as np
import pytest
from support.checkpoints import reference_file

from anectypes import sources
from anectypes.bench.cli import main as bench
from anectypes.data.corpus import builtin_dataset
from anectypes.data.tokenizer import Tokenizer
from anectypes.errors import AnectypesError
from anectypes.export import main as export_command
from anectypes.formats.checkpoint import save_checkpoint
from anectypes.formats.export import export
from anectypes.formats.llama2c import write_model
from anectypes.formats.portable import Portable
from anectypes.generate import main as generate
from anectypes.model.config import ModelConfig, init_params
from anectypes.runs import RunDir, RunSpec

pytestmark = pytest.mark.usefixtures("builtin_cache")

# head_dim = dim / heads (llama2.c's), GQA; 2 layers: α = 1/2, so folding it into wo and w2 is exact
DIMS = dict(dim=32, hidden=64, heads=4, kv_heads=2, head_dim=8, layers=2, seq=32)
COMMANDS = ("generate", "export", "train", "bench", "dashboard export", "dashboard generate")

# id: (SOURCE and its flags (paths under the fixture's folder), {command: the model it reads, or words of the
# error line}); a command missing from a row does not take its flags (train and bench: none; the dashboard: a run)
ROWS = {
    "run": (["runs/run"], {**dict.fromkeys(("generate", "export", "train", "bench"), "best"),
                           "dashboard export": "best"}),
    "run --checkpoint latest": (["runs/run", "--checkpoint", "latest"],
                                {"generate": "latest", "export": "latest", "dashboard export": "latest",
                                 "dashboard generate": "latest"}),
    "run without best.ckpt": (["runs/young"], {c: "young" for c in COMMANDS}),
    "run --checkpoint FILE": (["runs/run", "--checkpoint", "runs/young/checkpoints/latest.ckpt"],
                              {"generate": "young", "export": "young"}),
    "run on --data without --tokenizer": (["runs/data"], {
        **dict.fromkeys(("generate", "export", "dashboard export", "dashboard generate"),
                        "SOURCE has no tokenizer (its run trained on --data without --tokenizer)"),
        "train": "data", "bench": "data"}),
    ".ckpt in a run": (["runs/run/checkpoints/best.ckpt"], dict.fromkeys(("generate", "export", "train", "bench"),
                                                                         "best")),
    ".ckpt alone": (["alone.ckpt"], {"generate": "SOURCE has no tokenizer (it is not in a run folder)",
                                     "export": "SOURCE has no tokenizer (it is not in a run folder)",
                                     "train": "alone", "bench": "alone"}),
    ".ckpt alone --tokenizer": (["alone.ckpt", "--tokenizer", "tokenizer.bin"],
                                {"generate": "alone with tokenizer", "export": "alone with tokenizer"}),
    "model.bin": (["l2c/model.bin"], dict.fromkeys(("generate", "export", "train", "bench"), "l2c")),
    "model.bin's folder": (["l2c"], dict.fromkeys(("generate", "export", "train", "bench"), "l2c")),
    "model.bin, classifier unshared": (["unshared/model.bin"], {
        "generate": "unshared", "bench": "unshared",
        "export": "SOURCE: its classifier is not the embedding (unshared), but ours is tied",
        "train": "SOURCE: its classifier is not the embedding (unshared), but ours is tied"}),
    "model.bin's folder, classifier unshared": (["unshared"], {
        "generate": "unshared", "bench": "unshared",
        "export": "SOURCE: its classifier is not the embedding (unshared), but ours is tied",
        "train": "SOURCE: its classifier is not the embedding (unshared), but ours is tied"}),
    "Hugging Face folder": (["hf"], dict.fromkeys(("generate", "export", "train", "bench"), "hf")),
    "GGUF file": (["m.gguf"], dict.fromkeys(("generate", "export", "train", "bench"), "gguf")),
    "reference checkpoint": (["ref.bin"], {
        "generate": "SOURCE has no tokenizer (the reference's checkpoints hold none)",
        "export": "SOURCE has no tokenizer (the reference's checkpoints hold none)",
        "train": "reference", "bench": "reference"}),
    "reference checkpoint --tokenizer": (["ref.bin", "--tokenizer", "tokenizer.bin"],
                                         dict.fromkeys(("generate", "export"), "reference with tokenizer")),
    "weights holding NaN": (["nan/model.bin"], dict.fromkeys(("generate", "export", "train", "bench"),
                                                             "SOURCE: its embed holds NaN or inf")),
    "not a model": (["text.txt"], dict.fromkeys(("generate", "export", "train", "bench"),
                                                "SOURCE: not a llama2.c model")),
    "no such path": (["nothing"], dict.fromkeys(("generate", "export", "train", "bench"),
                                                "SOURCE: no such file or folder")),
    "a folder of nothing": (["empty"], dict.fromkeys(("generate", "export", "train", "bench"),
                                                     "SOURCE: not a run folder, a Hugging Face model folder")),
    "--checkpoint of a file": (["m.gguf", "--checkpoint", "latest"],
                               dict.fromkeys(("generate", "export"), "SOURCE: --checkpoint needs a run folder")),
    "--tokenizer of another size": (["m.gguf", "--tokenizer", "small.bin"], dict.fromkeys(
        ("generate", "export"), "the tokenizer has another vocabulary (300 tokens) than SOURCE's own (1024)")),
}


def random_params(cfg, seed):
    rng = np.random.default_rng(seed)
    return {k: (v * 4 if v.ndim == 2 else rng.uniform(0.5, 1.5, v.shape)).astype(np.float32)
            for k, v in init_params(cfg, rng).items()}


def folded(params):
    """The weights as llama2.c's and the other tools' files hold them: α = 1/2 folded into wo and w2."""
    return {k: v * np.float32(0.5) if k[-2:] in ("wo", "w2") else v for k, v in params.items()}


def expected(cfg, params, tokenizer=None, vocab_ids=None, classifier=None):
    return dict(cfg=cfg, params=params, tokenizer=tokenizer, vocab_ids=vocab_ids, classifier=classifier)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every kind of source under one folder, and what each holds: {name: expected()}."""
    base = tmp_path_factory.mktemp("sources")
    tok, corpus = builtin_dataset()
    cfg = ModelConfig(**DIMS, vocab=tok.vocab_size)
    tok.save(base / "tokenizer.bin")
    Tokenizer(tok.pieces[:300], tok.scores[:300]).save(base / "small.bin")
    data = corpus[:5000]
    data.astype(np.uint16).tofile(base / "data.bin")
    p = {name: random_params(cfg, seed) for seed, name in enumerate(
        ("best", "latest", "young", "data", "alone", "l2c", "unshared", "hf", "gguf", "nan"))}

    def ckpt(path, params):
        zero = {k: np.zeros_like(v) for k, v in params.items()}
        save_checkpoint(path, cfg, params, dict(t=0, m=zero, v=zero), {"step": 5})

    def run(name, spec, checkpoints):
        rd = RunDir(base / "runs" / name)
        rd.checkpoints.mkdir(parents=True)
        rd.write_config(dict(run_id=name, spec=RunSpec(**spec).resolved().to_dict(), model=cfg.to_dict()))
        for which, params in checkpoints.items():
            ckpt(rd.checkpoints / f"{which}.ckpt", params)

    run("run", dict(model="tiny"), {"best": p["best"], "latest": p["latest"]})
    run("young", dict(model="tiny"), {"latest": p["young"]})
    run("data", dict(model="tiny", data=str(base / "data.bin")), {"latest": p["data"]})
    ckpt(base / "alone.ckpt", p["alone"])
    classifier = random_params(cfg, 99)["embed"]
    p["nan"]["embed"][0] = np.nan
    for name in ("l2c", "unshared", "nan"):
        (base / name).mkdir()
        write_model(base / name / "model.bin", cfg, folded(p[name]), classifier if name == "unshared" else None)
        tok.save(base / name / "tokenizer.bin")
    export(Portable(cfg, p["hf"], tok), "hf", base / "hf")
    export(Portable(cfg, p["gguf"], tok), "gguf", base / "m.gguf")
    ref = reference_file(base / "ref.bin", heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          dims=(cfg.dim, cfg.hidden, cfg.layers, cfg.vocab, cfg.seq), scale=1e-5)
    ref = {k.removeprefix("param/"): a for k, a in ref.items() if k.startswith("param/")}
    (base / "text.txt").write_text("Once upon a time there was a file that was not a model at all.\n" * 20)
    (base / "empty").mkdir()
    active = np.unique(corpus)                           # the ids the built-in corpus holds
    want = {name: expected(cfg, p[name], tok, active) for name in ("best", "latest", "young")}
    want.update({"data": expected(cfg, p["data"], None, np.unique(data)),
                 "alone": expected(cfg, p["alone"]), "alone with tokenizer": expected(cfg, p["alone"], tok),
                 "l2c": expected(cfg, p["l2c"], tok), "hf": expected(cfg, p["hf"], tok),
                 "gguf": expected(cfg, p["gguf"], tok),
                 "unshared": expected(cfg, p["unshared"], tok, classifier=classifier),
                 "reference": expected(cfg, ref), "reference with tokenizer": expected(cfg, ref, tok)})
    return base, want


def same(source, want):
    pieces = lambda t: None if t is None else t.pieces
    arrays = lambda a, b: a is b is None or a is not None and b is not None and np.array_equal(a, b)
    return (source.cfg == want["cfg"] and source.params.keys() == want["params"].keys()
            and all(np.array_equal(source.params[k], a) for k, a in want["params"].items())
            and pieces(source.tokenizer) == pieces(want["tokenizer"])
            and arrays(source.vocab_ids, want["vocab_ids"]) and arrays(source.classifier, want["classifier"]))


class Spy:
    """sources.resolve, recording each call's source and answer (a Source, or the error raised)."""

    def __init__(self, monkeypatch):
        self.real, self.calls = sources.resolve, []
        monkeypatch.setattr(sources, "resolve", self)

    def __call__(self, source, *args, **kwargs):
        self.calls.append([str(source), None])
        try:
            self.calls[-1][1] = self.real(source, *args, **kwargs)
        except AnectypesError as e:
            self.calls[-1][1] = e
            raise
        return self.calls[-1][1]


def answer(command, base, argv, out, capsys):
    """Run one command on the source; its one error line, or None."""
    args = [a if a.startswith("--") or a == "latest" else str(base / a) for a in argv]
    if command == "train":                          # the call train --init-from makes
        try:
            sources.resolve(args[0])
        except AnectypesError as e:
            return str(e)
        return None
    if command.startswith("dashboard"):
        from fastapi.testclient import TestClient

        from anectypes.web.app import create_app
        run_id = argv[0].removeprefix("runs/")
        with TestClient(create_app(base / "runs"), base_url="http://127.0.0.1:8000") as c:
            if command == "dashboard export":
                body = {"format": "gguf", **dict(zip(("checkpoint",), argv[2:]))}
                r = c.post(f"/api/runs/{run_id}/export", json=body)
            else:
                r = c.post(f"/api/runs/{run_id}/generate", json={"max_tokens": 2, "temperature": 0})
        assert r.status_code in (200, 409), r.text
        return r.json()["detail"].split(": ", 1)[1] if r.status_code == 409 else None   # after "cannot export: "
    code = {"generate": lambda: generate([*args, "--steps", "2", "--temperature", "0", "--json", "--threads", "1"]),
            "export": lambda: export_command([*args, "--format", "gguf", "--out", str(out)]),
            "bench": lambda: bench(["generate", "--model", *args, "--steps", "2", "--rounds", "1", "--threads", "1",
                                    "--json"])}[command]()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert (code == 0) == (not errors) and len(errors) <= 1 and "Traceback" not in err, (command, err)
    return errors[0].removeprefix("error: ") if errors else None


@pytest.mark.parametrize("row", ROWS)
def test_every_command_resolves_a_source_alike(world, monkeypatch, capsys, tmp_path, row):
    base, want = world
    argv, expect = ROWS[row]
    spy = Spy(monkeypatch)
    seen = {}
    for command in expect:
        spy.calls.clear()
        line = answer(command, base, argv, tmp_path / f"{command}.gguf", capsys)
        assert len(spy.calls) == 1, (command, spy.calls)          # the command asked the resolver, once
        named, source = spy.calls[0]
        seen[command] = (line.replace(named, "SOURCE") if line else
                         next((name for name, w in want.items() if same(source, w)), "another model"))
    assert len({s for s in seen.values() if s not in want}) <= 1, seen      # one refusal, word for word
    assert {c: s if s in want else s[:len(expect[c])] for c, s in seen.items()} == expect
