"""`make models` in small (bench/models.py --quick): every study runs end to end on the real
all-MiniLM-L6-v2 and writes its report; the results hold what must hold whatever the method's
quality (exact attention reproduces the model, padding is honoured, distillation moves the
student towards the teacher, a char-LM learns). Tolerance for "reproduces": float32 rounding
through 6 layers, 2^-14 relative (see test_hf.py)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    docs = out / "docs" / "models.md"
    docs.parent.mkdir()
    subprocess.run([sys.executable, os.path.join(BENCH, "models.py"), "--quick", "--threads", "2", "--out", str(out),
                    "--docs", str(docs)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    return json.loads((out / "models.json").read_text()), docs


def test_zero_shot_rows(quick):
    results, _ = quick
    rows = {r["label"]: r for r in results["zero_shot"]}
    original, exact = rows["original (transformers sdpa)"], rows["exact (linattn_softmax)"]
    assert 1 - exact["cos_min"] <= 2.0 ** -14
    assert max(exact["layer_err"]) <= 2.0 ** -14
    assert exact["recall"] == original["recall"]
    approximate = [r for r in results["zero_shot"] if r.get("layer_err") and r is not exact]
    assert len(approximate) >= 4
    for r in approximate:  # an approximation: different, finite, and still an embedding of the text
        assert 0 < r["cos_mean"] < 1 and all(0 < e < math.inf for e in r["layer_err"]), r["label"]
        assert r["time_s"] > 0
    assert set(results["lengths"]) and all(len(v) == len(results["setup"]["lengths"]) for v in results["lengths"].values())


def test_distillation_moves_towards_the_teacher(quick):
    results, _ = quick
    runs = {r["which"]: r for r in results["distill"]}
    assert set(runs) == {"all", "qk"}
    assert runs["all"]["cos_after"] > runs["all"]["cos_before"]


def test_charlm_and_report(quick):
    results, docs = quick
    c = results["charlm"]["results"]
    assert len(c) == 2
    for r in c:
        assert r["steps"] > 0 and math.isfinite(r["final_bpc"]) and r["final_bpc"] < r["curve"][0][1], r["name"]
        assert len(r["sample"]) > 0
    text = docs.read_text()
    for heading in ("## Zero-shot swap", "## The gap against sequence length", "## Short distillation",
                    "## Training from scratch"):
        assert heading in text
    for r in results["zero_shot"]:
        assert "| %s |" % r["label"] in text
    for png in ("models_quick_layer_error.png", "models_quick_length.png"):
        assert (docs.parent / "img" / png).stat().st_size > 1000


def test_charlm_recurrent_decoding_equals_the_causal_forward():
    spec = importlib.util.spec_from_file_location("charlm", os.path.join(BENCH, "charlm.py"))
    charlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charlm)
    import torch
    torch.manual_seed(0)
    for name, method, options in charlm.DEFAULT_CONFIGS:
        if method == "softmax":
            continue
        model = charlm.CharLM(40, method, dim=32, heads=2, layers=2, context=48, **options).eval()
        charlm.check_recurrent(model, torch.randint(0, 40, (1, 20)))
