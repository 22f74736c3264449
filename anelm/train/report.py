"""The end of a run: a sample from the trained weights and the one-line summary."""

from __future__ import annotations

from .run import RunSetup


def sample_text(setup: RunSetup, n_tokens: int, seed: int, temperature: float = 0.5) -> str | None:
    """A short text from the trained weights on the CPU reference model (None: no tokenizer).

    Low temperature rather than greedy: a small model's argmax falls into loops quickly, and
    the seed keeps the sample reproducible.
    """
    tok = setup.tokenizer
    if tok is None or n_tokens <= 0:
        return None
    from ..generate.generate import generate
    from ..generate.sampling import make_sampler
    from ..models.loading import build_model

    cfg = setup.model_config
    start = cfg.bos_token_id if cfg.bos_token_id is not None else getattr(tok, "bos_id", None)
    prompt = [int(start)] if start is not None else tok.encode("Once upon a time")
    first = next(iter(getattr(setup.data, "examples_to_prompt", lambda: [])()), None)
    if first is not None:  # instruction data: the reply to the first valid example's prompt
        prompt = first
    room = cfg.max_position_embeddings - len(prompt)
    if not prompt or room <= 0:
        return None
    model = build_model(cfg, setup.params)
    res = generate(model, tok, prompt, max_tokens=min(n_tokens, room),
                   sampler=make_sampler(temperature, seed=seed))
    return res.text


def summary(setup: RunSetup, outcome) -> str:
    """One line: steps, time, final eval loss against the corpus's unigram entropy."""
    parts = [f"{outcome.steps_done} steps, {outcome.wall_s:.1f} s in this process"]
    if outcome.final_eval_loss is not None:
        h = setup.data.entropy
        parts.append(f"final eval loss {outcome.final_eval_loss:.4f} nats vs unigram entropy "
                     f"{h:.4f} nats ({outcome.final_eval_loss / h:.2f}x)")
    if outcome.best is not None:
        parts.append(f"lowest eval loss {outcome.best[1]:.4f} at step {outcome.best[0]} in {setup.run / 'best'}")
    parts.append(f"run folder {setup.run}")
    return "done: " + "; ".join(parts)
