"""Calibration statistics against transformers (FFN inputs, exact activations, the neurons'
contributions) and numpy (thresholds, frequencies); hot-first rewrite against the model before
reordering."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hf_tiny import VOCAB

from flashllm.format.reader import open_flash
from flashllm.runtime.layer_pass import LayerPass
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import (CalibrationError, active_mask, ffn_activations, frequencies,
                                           layer_thresholds, threshold)
from flashllm.sparsity.calibrate import calibrate_model, collect_ffn_inputs
from flashllm.sparsity.layer_stats import thresholds_of
from flashllm.convert.convert import convert

TOKENS = np.random.default_rng(7).integers(3, VOCAB, size=48)        # (48,)
N_CTX = 24


@pytest.fixture(scope="module")
def tiny(hf_tiny, tmp_path_factory):
    """name -> (transformers model, f32 flash folder)."""
    made = {}

    def get(name: str):
        if name not in made:
            folder, hf = hf_tiny(name)
            out = tmp_path_factory.mktemp(f"flash_{name}") / "m"
            convert(folder, out, "f32")
            made[name] = (hf, out)
        return made[name]
    return get


def _mlps(hf):
    """Per layer (module whose input is the FFN input h, function h -> reference activation)."""
    import torch
    if hasattr(hf.model, "decoder"):                                  # OPT: fc1 then relu
        layers = hf.model.decoder.layers
        return [(L.fc1, lambda h, L=L: torch.relu(L.fc1(h))) for L in layers]
    return [(L.mlp, lambda h, L=L: L.mlp.act_fn(L.mlp.gate_proj(h)) * L.mlp.up_proj(h))
            for L in hf.model.layers]


def _reference_inputs(hf, tokens, n_ctx):
    """Per layer the (N, d) FFN inputs transformers sees, chunk by chunk from an empty context."""
    import torch
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, []).append(
        args[0].detach().reshape(-1, args[0].shape[-1]).numpy().copy())) for i, (m, _) in enumerate(_mlps(hf))]
    try:
        with torch.no_grad():
            for s in range(0, len(tokens), n_ctx):
                hf(torch.tensor(tokens[s:s + n_ctx])[None])
    finally:
        for h in hooks:
            h.remove()
    return [np.concatenate(seen[i]) for i in range(len(seen))]


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "opt"])
def test_inputs_and_activations_match_transformers(tiny, name):
    import torch
    hf, path = tiny(name)
    flash = open_flash(path)
    ours = collect_ffn_inputs(Model(flash, n_ctx=N_CTX), TOKENS, n_ctx=N_CTX)
    ref = _reference_inputs(hf, TOKENS, N_CTX)
    crit = "glu_product" if flash.config.glu else "relu"
    for layer, (h_ours, h_ref) in enumerate(zip(ours, ref)):
        assert h_ours.shape == h_ref.shape == (len(TOKENS), flash.config.d_model)
        np.testing.assert_allclose(h_ours, h_ref, rtol=1e-4, atol=1e-4 * np.abs(h_ref).max())
        with torch.no_grad():
            want = _mlps(hf)[layer][1](torch.from_numpy(h_ref)).numpy()    # (N, n_ff)
        got = ffn_activations(flash, layer, h_ref, crit)                    # (N, n_ff)
        want = np.abs(want) if crit == "glu_product" else want
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "opt"])
def test_layer_major_pass_matches_transformers(tiny, name):
    """LayerPass (one layer at a time over all tokens, weights read from the folder) gives
    each layer's FFN inputs and the final perplexity transformers gives, chunk by chunk."""
    import torch
    hf, path = tiny(name)
    flash = open_flash(path)
    got = {}
    net = LayerPass(flash, n_ctx=N_CTX)
    x = net.run(TOKENS, on_input=lambda i, h: got.setdefault(i, h.copy()))
    ref = _reference_inputs(hf, TOKENS, N_CTX)
    assert sorted(got) == list(range(len(ref))) and x.shape == (len(TOKENS), flash.config.d_model)
    for i, h_ref in enumerate(ref):
        np.testing.assert_allclose(got[i], h_ref, rtol=1e-4, atol=1e-4 * np.abs(h_ref).max())
    nll = []
    with torch.no_grad():                   # llama.cpp's perplexity: the second half of a chunk
        for s in range(0, len(TOKENS), N_CTX):
            chunk = torch.tensor(TOKENS[s:s + N_CTX])[None]
            logp = torch.log_softmax(hf(chunk).logits[0].double(), -1).numpy()  # (N_CTX, vocab)
            first = N_CTX // 2
            nll += [-logp[t, TOKENS[s + t + 1]] for t in range(first, N_CTX - 1)]
    assert net.perplexity(TOKENS) == pytest.approx(np.exp(np.mean(nll)), rel=1e-4)
    net.close()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_thresholds_by_radix_select_are_numpy_partitions(n, n_ff, s, seed):
    """layer_stats.thresholds_of (no copy of the scores) == activations.threshold (a sorted
    copy), ties, zeros and huge values included."""
    rng = np.random.default_rng(seed)
    a = np.abs(rng.standard_normal((n, n_ff))).astype(np.float32)       # (n, n_ff)
    a[rng.random(a.shape) < 0.2] = 0.0
    a[rng.random(a.shape) < 0.1] = np.float32(1.5)
    a[rng.random(a.shape) < 0.02] = np.float32(3e38)
    targets = [s, 0.5, 0.0, 1.0, 0.999]
    assert thresholds_of(a, targets) == {t: threshold(a, t) for t in targets}


def test_callback_sees_every_chunk_of_every_layer(tiny):
    _, path = tiny("llama")
    flash = open_flash(path)
    calls = []
    assert collect_ffn_inputs(Model(flash, n_ctx=N_CTX), TOKENS, n_ctx=N_CTX,
                              on_input=lambda l, h: calls.append((l, h.shape))) is None
    d, L = flash.config.d_model, flash.config.n_layers
    assert calls == [(l, (N_CTX, d)) for _ in range(2) for l in range(L)]


def test_gate_criterion_is_cats(tiny):
    import torch
    hf, path = tiny("llama")
    flash = open_flash(path)
    h = np.random.default_rng(3).standard_normal((5, flash.config.d_model)).astype(np.float32)
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():
        want = np.abs(mlp.act_fn(mlp.gate_proj(torch.from_numpy(h))).numpy())
    np.testing.assert_allclose(ffn_activations(flash, 1, h, "gate"), want, rtol=1e-4, atol=1e-6)
    with pytest.raises(CalibrationError, match="GLU"):
        ffn_activations(open_flash(tiny("opt")[1]), 0, h[:, :64], "gate")


@pytest.mark.parametrize("s", [0.0, 0.3, 0.5, 0.7, 0.95, 1.0])
def test_threshold_gives_the_target_sparsity(s):
    scores = np.abs(np.random.default_rng(1).standard_normal((300, 77))).astype(np.float32)
    t = threshold(scores, s)
    below = (scores < t).mean()
    assert below == pytest.approx(round(s * scores.size) / scores.size, abs=0)
    if 0 < s < 1:   # numpy's quantile at the order statistic k = round(s * N)
        k = round(s * scores.size)
        assert t == np.quantile(scores, k / (scores.size - 1), method="nearest")
    assert active_mask(scores, t, "glu_product").mean() == pytest.approx(1 - below)


def test_layer_thresholds_and_frequencies_vs_numpy():
    rng = np.random.default_rng(2)
    acts = [np.abs(rng.standard_normal((200, 50)) * rng.uniform(0.1, 3, 50)).astype(np.float32)
            for _ in range(3)]                                           # per layer (200, 50)
    ts = layer_thresholds(acts, 0.6)
    for a, t in zip(acts, ts):
        assert t == pytest.approx(float(np.sort(a.ravel())[round(0.6 * a.size)]))
        f = frequencies(a, t, "glu_product")
        np.testing.assert_array_equal(f, [(a[:, j] >= t).sum() / 200 for j in range(50)])
    relu = np.maximum(rng.standard_normal((10, 4)), 0)
    np.testing.assert_array_equal(frequencies(relu, 123.0, "relu"), (relu > 0).mean(0))
    with pytest.raises(CalibrationError, match="sparsity"):
        threshold(acts[0], 1.5)


# ---- the whole calibration and the hot-first rewrite --------------------------------------

def _fresh(tiny, name, tmp_path):
    import shutil
    _, path = tiny(name)
    out = tmp_path / "m"
    shutil.copytree(path, out)
    return out


def _reference_freq(hf, thresholds, criterion):
    """(L, n_ff) per-neuron-id activation frequency from transformers' own activations."""
    import torch
    out = []
    for layer, h in enumerate(_reference_inputs(hf, TOKENS, N_CTX)):
        with torch.no_grad():
            a = _mlps(hf)[layer][1](torch.from_numpy(h)).numpy()             # (N, n_ff)
        out.append((a > 0).mean(0) if criterion == "relu" else (np.abs(a) >= thresholds[layer]).mean(0))
    return np.stack(out)


def _reference_contribution(hf):
    """(L, n_ff) per neuron id E|h| * ||down column|| from transformers' activations and
    weights."""
    import torch
    out = []
    for layer, h in enumerate(_reference_inputs(hf, TOKENS, N_CTX)):
        with torch.no_grad():
            a = _mlps(hf)[layer][1](torch.from_numpy(h)).numpy()             # (N, n_ff)
        down = hf.model.decoder.layers[layer].fc2 if hasattr(hf.model, "decoder") \
            else hf.model.layers[layer].mlp.down_proj
        norms = np.linalg.norm(down.weight.detach().numpy(), axis=0)         # (n_ff,)
        out.append(np.abs(a).mean(0) * norms)
    return np.stack(out)


def _logits_match(hf, path, tokens):
    import torch
    from flashllm.runtime.model import Model
    ours = Model(open_flash(path, verify=True), n_threads=1, n_ctx=64).forward(tokens, 0)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-3


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_calibrate_writes_thresholds_and_a_hot_first_order(tiny, tmp_path, name):
    hf, _ = tiny(name)
    path = _fresh(tiny, name, tmp_path)
    for run in range(2):                                   # the second run reorders a reordered model
        sec = calibrate_model(*_flash_and_model(path), TOKENS, {"source": "test"}, 0.5)
        flash = open_flash(path, verify=True)
        assert flash.manifest["sparsity"] == json_roundtrip(sec) and sec["hot_first"]
        assert sorted(p.name for p in path.iterdir()) == sorted(
            ["manifest.json", "dense.bin", "tokenizer.json", flash.ffn.file.name,
             flash.manifest["ffn"]["neuron_order"]["file"], sec["frequency"]["file"]])
        order, freq = flash.ffn.neuron_order, _frequency(flash)                # (L, n_ff) each
        if name == "opt":                                                      # ReLU: by frequency
            assert sec["order_by"] == "frequency" and np.all(np.diff(freq, axis=1) <= 0)
        else:                                                                  # GLU: contribution
            assert sec["order_by"] == "contribution"
            c = np.take_along_axis(_reference_contribution(hf), order, axis=1)  # (L, n_ff) by slot
            assert np.all(np.diff(c, axis=1) <= 1e-4 * c.max())               # largest first
        ref = _reference_freq(hf, sec["thresholds"], sec["criterion"])        # by neuron id
        np.testing.assert_allclose(freq, np.take_along_axis(ref, order, axis=1), atol=1.5 / len(TOKENS))
        if sec["criterion"] != "relu":
            np.testing.assert_allclose(sec["achieved"], 0.5, atol=0.02)
        _logits_match(hf, path, TOKENS[:40])


def json_roundtrip(x):
    import json
    return json.loads(json.dumps(x))


@pytest.mark.parametrize("where", ["ffn", "manifest"])
def test_interrupted_calibration_leaves_the_model_valid(tiny, tmp_path, monkeypatch, where):
    import flashllm.sparsity.reorder as reorder
    from flashllm.format.reader import FlashModel
    hf, _ = tiny("llama")
    path = _fresh(tiny, "llama", tmp_path)
    before = (path / "manifest.json").read_bytes()
    armed = []
    if where == "ffn":          # stop while the reordered FFN file is half written
        real_perm, real_read = reorder.hot_first_permutation, FlashModel.read_ffn_layer

        def read(self, layer):
            if armed and layer == 1:
                raise KeyboardInterrupt
            return real_read(self, layer)
        monkeypatch.setattr(reorder, "hot_first_permutation", lambda f: armed.append(1) or real_perm(f))
        monkeypatch.setattr(FlashModel, "read_ffn_layer", read)
    else:                       # stop just before the manifest switch
        def switch(*args, **kwargs):
            raise KeyboardInterrupt
        import flashllm.format.files as files
        monkeypatch.setattr(files, "update_manifest", switch)
    with pytest.raises(KeyboardInterrupt):
        calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5)
    assert (path / "manifest.json").read_bytes() == before
    assert not [p for p in path.iterdir() if p.name.startswith(".")]       # no temporary files
    monkeypatch.undo()
    _logits_match(hf, path, TOKENS[:40])
    calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5)       # a rerun succeeds
    _logits_match(hf, path, TOKENS[:40])


def test_cli_calibrate_then_sparse_perplexity(tiny, tmp_path):
    import json
    from typer.testing import CliRunner
    from flashllm.cli import app
    path = _fresh(tiny, "llama", tmp_path)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in TOKENS), encoding="utf-8")
    r = CliRunner().invoke(app, ["calibrate", str(path), "--text", str(text), "--tokens", "48",
                                 "--ctx", "24", "--sparsity", "0.4", "-t", "1", "--keep-target"])
    assert r.exit_code == 0, r.output
    assert "perplexity" not in r.output                  # --keep-target: no quality check
    assert "training a gate_up predictor on 48 tokens x" in r.output     # says what takes time
    sec = open_flash(path, verify=True).manifest["sparsity"]
    assert (sec["target"], sec["criterion"], sec["hot_first"]) == (0.4, "glu_product", True)
    assert sec["calibration"]["text"]["source"] == "file" and sec["calibration"]["n_tokens"] == 48
    from flashllm.sparsity.predictor import load_predictor
    flash = open_flash(path, verify=True)
    pred = load_predictor(flash)                       # the default for GLU models, trained after
    assert pred is not None and pred.kind == "gate_up"  # the hot-first rewrite, in its slot order
    h = np.random.default_rng(0).standard_normal((1, flash.config.d_model)).astype(np.float32)
    assert pred.predict(0, h).max() < flash.config.n_ff
    r = CliRunner().invoke(app, ["perplexity", str(path), str(text), "--ctx", "24", "--sparsity",
                                 "0.4", "--json", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert "using the model's calibrated thresholds" in r.output
    assert "[1/2] " in r.output and "min left" in r.output and "[2/2] " in r.output   # an ETA
    out = json.loads(r.output.strip().splitlines()[-1])
    assert (out["count"], out["n_chunks"], out["sparsity"]) == (22, 2, 0.4)
    r = CliRunner().invoke(app, ["perplexity", str(path), "-f", str(text), "-c", "24",
                                 "--sparsity", "0.4", "--json", "-t", "1"])   # llama.cpp's names
    same = json.loads(r.output.strip().splitlines()[-1]) if r.exit_code == 0 else {}
    assert {**same, "seconds": 0} == {**out, "seconds": 0}, r.output
    r = CliRunner().invoke(app, ["perplexity", str(path), str(text), "-f", str(text)])
    assert r.exit_code == 1 and "give the text file once" in r.output
    r = CliRunner().invoke(app, ["calibrate", str(path), "--text", str(text), "--tokens", "999"])
    assert r.exit_code == 1 and "999 were asked for" in r.output
    r = CliRunner().invoke(app, ["calibrate", str(path), "--text", str(text), "--predictor", "x"])
    said = lambda r: " ".join(r.output.replace("│", " ").split())        # noqa: E731 (unwrap the box)
    assert r.exit_code == 2 and "'x' is not one of 'default', 'none'" in said(r)
    for opt, bad in (("--criterion", "cats"), ("--corpus", "poetry")):
        r = CliRunner().invoke(app, ["calibrate", str(path), opt, bad])
        assert r.exit_code == 2 and f"'{bad}' is not one of" in said(r), r.output


def test_cli_calibrates_on_the_mix_and_inspect_says_what_it_checked(tiny, tmp_path):
    """calibrate's default text is the mix of the shipped kinds; it checks the target on each,
    says how long it should take and took, and `inspect` says what each text cost."""
    from typer.testing import CliRunner
    from flashllm.cli import app
    path = _fresh(tiny, "llama", tmp_path)
    r = CliRunner().invoke(app, ["calibrate", str(path), "--tokens", "48", "--ctx", "24", "-t",
                                 "1", "--predictor", "none", "--max-ppl-cost", "50"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "calibrating on 48 tokens, layer by layer: about 1 min (up to" in said
    assert "sparsity 0.5: perplexity" in said and " on english" in said
    sec = open_flash(path).manifest["sparsity"]
    checked = sec["quality"]["checked"]
    assert [(c["text"], c["tokens"]) for c in checked] == [("code", 12), ("prose", 12),
                                                           ("english", 12), ("literature", 12)]
    took = sec["calibration"]["seconds"]          # tenths: a tiny model's can round to 0.0
    assert isinstance(took, float) and took >= 0 and sec["calibration"]["text"]["source"] == "mix"
    r = CliRunner().invoke(app, ["inspect", str(path)])
    shown = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 0 and f"target {sec['target']}" in shown, r.output
    for c in checked:
        assert f"{c['ppl_cost']:+.1%} on {c['text']} (12 tokens)" in shown, shown
    assert "48 tokens of code (python-stdlib, 12 tokens), prose" in shown and " took " in shown
    assert "literature (public-domain-literature, 12 tokens)" in shown


def test_calibrate_lowers_the_target_while_it_costs_perplexity(tiny, tmp_path):
    """With a bound, calibrate keeps the largest of the targets 0.5, 0.4, ..., 0 whose thresholds
    (numpy quantiles of the activations, layer by layer) cost at most the bound of perplexity
    against the dense model on the calibration tokens — each cost measured here on its own
    models; without a bound the target stays."""
    from flashllm.generation.perplexity import perplexity
    from flashllm.runtime.ffn import DenseFfn
    path = _fresh(tiny, "llama", tmp_path)
    flash = open_flash(path)
    inputs = collect_ffn_inputs(Model(flash, n_ctx=N_CTX), TOKENS, n_ctx=N_CTX)
    scores = [ffn_activations(flash, i, h) for i, h in enumerate(inputs)]   # per layer (N, n_ff)

    def ppl(ths):             # None: the dense model's own FFN
        ffn = None
        if ths is not None:
            ffn = DenseFfn(flash, 1, threshold=[1.0] * len(ths))         # the bundles' FFN
            ffn.threshold = ths
        return perplexity(Model(flash, n_ctx=N_CTX, ffn=ffn), TOKENS, n_ctx=N_CTX).ppl

    base = ppl(None)
    bundles = ppl([0.0] * len(scores)) / base - 1                 # no term dropped
    cost = {s: ppl([threshold(x, s) for x in scores]) / base - 1 for s in (0.5, 0.4, 0.3, 0.2, 0.1)}
    bound = sorted(cost.values())[2] + 1e-9                # three targets within, two not
    want = max(s for s, c in cost.items() if c <= bound)
    sec = calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5, max_cost=bound)
    assert sec["target"] == want and sec["quality"]["requested"] == 0.5
    assert sec["quality"]["ppl_cost"] == pytest.approx(cost[want], abs=1e-4)
    assert sec["quality"]["version"] == 2             # is_calibrated's stamp
    assert sec["thresholds"] == pytest.approx([threshold(x, want) for x in scores], rel=1e-5)
    path = _fresh(tiny, "llama", tmp_path / "b")
    sec = calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5, max_cost=-1.0)
    assert sec["target"] == 0.0 and sec["thresholds"] == [0.0] * len(scores)   # none within
    assert sec["quality"]["ppl_cost"] == pytest.approx(bundles, abs=1e-4)   # their own cost
    path = _fresh(tiny, "llama", tmp_path / "c")
    assert calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5)["target"] == 0.5


def test_calibrate_keeps_a_target_within_the_bound_on_every_text(tiny, tmp_path):
    """Calibrated on two texts (parts), each target's thresholds (numpy quantiles over all the
    tokens) are checked on each text's own tokens against the dense model, each cost
    measured here on its own models; the largest target within the bound on both is
    kept — with a bound one text alone would have let a higher target through — and the
    section says what it costs on each."""
    from flashllm.generation.perplexity import perplexity
    from flashllm.runtime.ffn import DenseFfn
    path = _fresh(tiny, "llama", tmp_path)
    flash = open_flash(path)
    inputs = collect_ffn_inputs(Model(flash, n_ctx=N_CTX), TOKENS, n_ctx=N_CTX)
    scores = [ffn_activations(flash, i, h) for i, h in enumerate(inputs)]   # per layer (N, n_ff)
    parts = {"a": TOKENS[:24], "b": TOKENS[24:]}

    def ppl(ths, ids):        # None: the dense model's own FFN
        ffn = None
        if ths is not None:
            ffn = DenseFfn(flash, 1, threshold=[1.0] * len(ths))         # the bundles' FFN
            ffn.threshold = ths
        return perplexity(Model(flash, n_ctx=N_CTX, ffn=ffn), ids, n_ctx=N_CTX).ppl

    cost = {s: {name: ppl([threshold(x, s) for x in scores], ids) / ppl(None, ids) - 1
                for name, ids in parts.items()} for s in (0.5, 0.4, 0.3, 0.2, 0.1)}
    kept = lambda bound, names: max((s for s, c in cost.items()            # noqa: E731
                                     if all(c[n] <= bound for n in names)), default=0.0)
    bound = next(b + 1e-9 for b in sorted(c for by in cost.values() for c in by.values())
                 if kept(b + 1e-9, "a") != kept(b + 1e-9, "ab") or
                 kept(b + 1e-9, "b") != kept(b + 1e-9, "ab"))
    want = kept(bound, "ab")
    sec = calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5, max_cost=bound,
                          parts=[("a", 24), ("b", 24)])
    assert sec["target"] == want and sec["quality"]["requested"] == 0.5
    assert [(c["text"], c["tokens"]) for c in sec["quality"]["checked"]] == [("a", 24), ("b", 24)]
    for c in sec["quality"]["checked"]:
        assert c["ppl_cost"] == pytest.approx(cost[want][c["text"]] if want else 0.0, abs=1e-4)
    assert sec["quality"]["ppl_cost"] == max(c["ppl_cost"] for c in sec["quality"]["checked"])
    assert sec["calibration"]["text"]["parts"] == [{"text": "a", "n_tokens": 24},
                                                   {"text": "b", "n_tokens": 24}]


def test_a_mix_is_every_shipped_kind_in_equal_shares(tmp_path):
    """calibrate's default text: the first tokens of each shipped kind, n_tokens split evenly,
    each a part of its own (what the checks measure separately)."""
    from hf_tiny import write_tokenizer
    from flashllm.session.calibration import calibration_ids, calibration_texts
    from flashllm.generation.tokenizer import Tokenizer
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_json((tmp_path / "tokenizer.json").read_bytes())
    text, ids, parts = calibration_texts(tok, None, "mix", 2050)
    assert parts == [("code", 513), ("prose", 513), ("english", 512), ("literature", 512)]
    assert ids == sum((calibration_ids(tok, None, kind, n)[1] for kind, n in parts), [])
    assert [t["kind"] for t in text["texts"]] == ["code", "prose", "english", "literature"]
    text, ids, parts = calibration_texts(tok, None, "english", 300)
    assert parts == [("english", 300)] and text["source"] == "flashllm-english"
    with pytest.raises(CalibrationError, match="at least 16 tokens"):
        calibration_texts(tok, None, "mix", 5)


def test_a_calibration_checked_by_an_older_rule_is_calibrated_again():
    """A conversion whose target was checked before every text was (no "checked"), or on the
    mix without literature against the bundles (no version 2 stamp), is not calibrated for a
    budgeted run; one checked by the current rule, or kept as asked, is."""
    from flashllm.session.calibration import is_calibrated
    man = lambda q: {"config": {}, "ffn": {"neuron_order": {"file": "o"}},   # noqa: E731
                     "sparsity": {"quality": q}}
    checked = [{"text": "code", "tokens": 512, "ppl_cost": 0.01}]
    assert not is_calibrated(man({"requested": 0.5, "ppl_cost": 0.01, "bound": 0.02}))
    assert not is_calibrated(man({"requested": 0.5, "ppl_cost": 0.01, "bound": 0.02,
                                  "checked": checked}))
    assert is_calibrated(man({"requested": 0.5, "ppl_cost": 0.01, "bound": 0.02,
                              "checked": checked, "version": 2}))
    assert is_calibrated(man({"requested": 0.4}))                   # --keep-target
    from flashllm.cli.views import calibration_words                 # and inspect says so
    shown = lambda q: calibration_words({"calibrated": True, "sparsity": {   # noqa: E731
        "target": 0.4, "quality": {"requested": 0.5, "ppl_cost": 0.01, "bound": 0.02,
                                   "checked": checked, **q}, "calibration": {"n_tokens": 2048}}})
    assert "older rule" in shown({}) and "older rule" not in shown({"version": 2})


def _flash_and_model(path):
    """The folder opened and its model made to run layer by layer (as calibrate runs it)."""
    flash = open_flash(path)
    return flash, LayerPass(flash, n_ctx=N_CTX)


def _frequency(flash) -> np.ndarray:
    """(n_layers, n_ff) f32: the per-slot frequencies the manifest's sparsity section points to."""
    entry, cfg = flash.manifest["sparsity"]["frequency"], flash.config
    assert entry["shape"] == [cfg.n_layers, cfg.n_ff] and entry["dtype"] == "float32"
    return np.fromfile(flash.path / entry["file"], dtype="<f4").reshape(cfg.n_layers, cfg.n_ff)


def test_the_shipped_text_is_read_until_a_word_level_vocabulary_has_its_tokens(tmp_path):
    """calibrate reads the shipped text at 8 characters a token; a word-level tokenizer (a tiny
    Hugging Face model's) makes one token of a whole word, so it reads more of it (at 8 a token
    its 2048 tokens were 1946 and calibrate refused), and says so when all of it is too short."""
    from hf_tiny import write_tokenizer
    from flashllm.session.calibration import calibration_ids
    from flashllm.sparsity.corpus import builtin_text
    from flashllm.generation.tokenizer import Tokenizer
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_json((tmp_path / "tokenizer.json").read_bytes())
    few = len(tok.encode(builtin_text("calibration", "code", 8 * 2048).text))
    assert few < 2048                                         # what 8 characters a token gave
    source, ids = calibration_ids(tok, None, "code", 2048)
    assert len(ids) == 2048 and ids == tok.encode(source.text)[:2048]
    with pytest.raises(CalibrationError, match="2000000 were asked for"):
        calibration_ids(tok, None, "code", 2_000_000)


def test_calibrate_sweeps_a_killed_calibrations_files_and_a_predictor_it_reorders(tiny, tmp_path):
    """A calibration OOM-killed mid-rewrite leaves .NAME.tmp-PID files in the folder: the next
    one removes those whose process is gone (not a live writer's); a predictor trained in the
    slots a rewrite reorders is dropped when no new one is trained."""
    import os
    import subprocess
    import sys
    path = _fresh(tiny, "llama", tmp_path)
    calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5, predictor="gate_up")
    assert open_flash(path).manifest["predictor"]["kind"] == "gate_up"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead, live = path / f".ffn.bin.tmp-{gone}", path / f".order-hot.bin.tmp-{os.getppid()}"
    dead.write_bytes(b"half")
    live.write_bytes(b"busy")
    calibrate_model(*_flash_and_model(path), TOKENS, {}, 0.5)
    assert not dead.exists() and live.exists()
    live.unlink()
    assert not open_flash(path, verify=True).manifest.get("predictor")
    _logits_match(tiny("llama")[0], path, TOKENS[:40])
