"""metrics.jsonl, loss.png, the progress bar, and the model presets."""

import io
import json

import pytest

from anelm.errors import UsageError
from anelm.train import metrics as M
from anelm.train import presets as P
from anelm.train.errors import PresetError


def log_some(run, steps=range(1, 6)):
    with M.MetricsLog(run) as log:
        for s in steps:
            log.log_step(s, loss=5.0 / s, lr=1e-3, loss_scale=4096.0, tokens_per_s=1000.0,
                         device="emulator", device_flops=2_000, cpu_flops=1_000, skipped=False)
            if s % 2 == 0:
                log.log_eval(s, eval_loss=6.0 / s)


def test_metrics_jsonl_records(tmp_path):
    log_some(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert len(steps) == 5 and len(evals) == 2 and len(lines) == 7
    assert set(steps[0]) >= {"step", "loss", "lr", "loss_scale", "tokens_per_s", "device",
                             "device_flops", "cpu_flops"}
    assert all("loss" not in r for r in evals) and evals[0] == {"step": 2, "eval_loss": 3.0}


def test_non_finite_is_null_and_keys_cannot_be_mixed(tmp_path):
    with M.MetricsLog(tmp_path) as log:
        log.log_step(1, float("nan"), 1e-3, 1.0, 0.0, "emulator", 0, 0)
        with pytest.raises(ValueError):
            log.log_eval(1, 2.0, loss=1.0)
        with pytest.raises(ValueError):
            log.log_step(1, 1.0, 1e-3, 1.0, 0.0, "emulator", 0, 0, eval_loss=1.0)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] is None


def test_resume_drops_records_past_the_checkpoint_and_torn_lines(tmp_path):
    log_some(tmp_path, range(1, 9))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # killed mid-write
    with M.MetricsLog(tmp_path, resume_step=5) as log:
        log.log_step(6, 0.5, 1e-3, 1.0, 1.0, "emulator", 0, 0)
    recs = M.read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 2, 3, 4, 4, 5, 6]


def test_loss_png_written_and_replaced(tmp_path):
    log_some(tmp_path)
    path = M.plot_loss(tmp_path)
    first = path.read_bytes()
    assert path.name == "loss.png" and first[:8] == b"\x89PNG\r\n\x1a\n" and len(first) > 5000
    log_some(tmp_path, range(6, 30))
    assert M.plot_loss(tmp_path).read_bytes() != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    (tmp_path / "empty").mkdir()
    assert M.plot_loss(tmp_path / "empty").exists()  # no records yet: an empty plot, no error


def test_loss_axis_is_log_with_the_entropy_line(tmp_path):
    log_some(tmp_path, range(1, 30))
    fig = M.loss_figure(M.read_metrics(tmp_path), reference=4.77)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    ref = [ln for label, ln in lines.items() if "unigram entropy" in label]
    assert len(ref) == 1 and "4.77 nats" in ref[0].get_label()
    assert set(ref[0].get_ydata()) == {4.77}  # horizontal, at the entropy
    assert {"train", "eval"} <= set(lines)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert ref[0].get_label() in legend
    assert M.loss_figure([], reference=None).axes[0].get_lines() == []  # nothing to draw yet


def test_progress_bar_on_stderr(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(M.sys, "stderr", err)
    bar = M.Progress(total=10, disable=False)
    bar.update(3, loss=2.5, tokens_per_s=12345.0)
    bar.close()
    out = err.getvalue()
    assert "3/10" in out and "loss=2.5000" in out and "tok/s=12,345" in out and "<" in out  # ETA


def test_presets_shapes_and_sizes():
    assert list(P.PRESETS) == ["tiny", "stories15m", "stories42m", "stories110m", "qwen3-0.6b"]
    assert 1e6 <= P.count_params(P.get_preset("tiny")) <= 4e6
    assert P.get_preset("tiny")["max_position_embeddings"] <= 128
    s = P.get_preset("stories110m")
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
            s["intermediate_size"], s["vocab_size"]) == (768, 12, 12, 2048, 32000)
    assert P.count_params(s) == 109_529_856  # the 109.53 M of the reference trainer
    assert P.get_preset("stories15m")["intermediate_size"] == 768
    assert P.get_preset("stories42m")["intermediate_size"] == 1376
    q = P.get_preset("qwen3-0.6b")
    assert (q["num_key_value_heads"], q["head_dim"], q["rope_theta"]) == (8, 128, 1e6)
    assert "model.layers.0.self_attn.q_norm.weight" in P.hf_weight_shapes(q)
    assert "lm_head.weight" in P.hf_weight_shapes({**s, "tie_word_embeddings": False})


@pytest.mark.parametrize("name", list(P.PRESETS))
def test_presets_build_hf_models_with_the_same_weight_shapes(name):
    import torch
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    cfg = {**P.get_preset(name), "num_hidden_layers": 1, "vocab_size": 256}  # small to build
    qwen = cfg["model_type"] == "qwen3"
    mod, cls = (modeling_qwen3, "Qwen3") if qwen else (modeling_llama, "Llama")
    with torch.device("meta"):  # shapes only, no memory
        model = getattr(mod, cls + "ForCausalLM")(getattr(mod, cls + "Config")(**cfg))
    got = {n: tuple(p.shape) for n, p in model.state_dict().items() if "rotary" not in n}
    if cfg["tie_word_embeddings"]:
        got.pop("lm_head.weight", None)
    assert got == P.hf_weight_shapes(cfg)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(PresetError, match="unknown preset 'Stories15M'; expected one of: tiny, "
                                          "stories15m, stories42m, stories110m, qwen3-0.6b"):
        P.get_preset("Stories15M")
    assert issubclass(PresetError, UsageError)
    a = P.get_preset("tiny")
    a["hidden_size"] = 1
    assert P.get_preset("tiny")["hidden_size"] == 128  # callers get copies
