"""One stream of a run: its sampler, drafter, one-shot completion or chat session, and what it
measured (the timings, the flash counters). A run has one; a server would have one a request,
over one assembled model (session/run.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from flashllm.errors import FlashError
from flashllm.limits import read_capped

MAX_TEMPLATE_BYTES = 1 << 20     # a --chat-template file (real ones: a few KiB)


@dataclass(frozen=True)
class Sampling:
    """The sampler's settings, as llama.cpp names them (seed None: random)."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: Optional[int] = None
    ignore_eos: bool = False     # never draw an end-of-generation token (llama.cpp's --ignore-eos)

    def params(self, eog_ids=()):
        """SamplerParams; eog_ids: the model's end-of-generation tokens, banned by ignore_eos."""
        from flashllm.generation.sampler import SamplerParams
        return SamplerParams(temp=self.temp, top_k=self.top_k, top_p=self.top_p,
                             min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                             repeat_last_n=self.repeat_last_n, seed=self.seed,
                             banned=tuple(int(t) for t in eog_ids) if self.ignore_eos else ())

    def sampler(self, eog_ids=()):
        from flashllm.generation.sampler import Sampler
        return Sampler(self.params(eog_ids))

    def head_need(self):
        """What of the output head the sampler can keep (sparse_head.head_need; None: all)."""
        import dataclasses
        from flashllm.runtime.sparse_head import head_need
        need = head_need(self.params())
        return dataclasses.replace(need, no_eog=True) if need and self.ignore_eos else need


def complete(parts, sampler, n_predict: int, draft, write: Callable[[str], None],
             on_prefill=None):
    """One-shot generation of parts' prompt: text handed to write as tokens come (and the
    detokenizer's rest at the end); the GenStats. on_prefill(done, total): a long prompt's
    prefill progress (generate.generate)."""
    from flashllm.generation.generate import generate
    detok = parts.tok.detokenizer()
    stats = generate(parts.net, sampler, parts.ids, n_predict, stop_ids=parts.tok.eos_ids,
                     on_token=lambda token: write(detok.push(token)), draft=draft,
                     on_prefill=on_prefill)
    write(detok.flush())
    return stats


def chat_session(parts, sampler, system: Optional[str], template_text: Optional[str],
                 n_predict: int, draft=None):
    """(a ChatSession over parts with the model's chat template, or template_text, where the
    template came from)."""
    from flashllm.generation.chat import ChatSession
    from flashllm.generation.chat_template import load_template
    cfg, tok = parts.flash.config, parts.tok
    bos = tok.hf.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    eos = tok.hf.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
    template, origin = load_template(parts.flash.chat_template, template_text, bos or "",
                                     eos or "", cfg.arch)
    return ChatSession(parts.net, tok, sampler, template, system=system, n_predict=n_predict,
                       draft=draft), origin


def chat_loop(session, read, write, note, color: bool, history) -> None:
    """The chat's read-answer loop (generation/chat.py repl) until EOF or /bye; history: the
    line-editing history file (None: none)."""
    from flashllm.generation.chat import Interrupt, ReplIO, line_editing, repl
    io = ReplIO(read=read, write=write, note=note, color=color)
    with line_editing(history):
        repl(session, io, Interrupt())


def read_template(path) -> str:
    """A --chat-template file's text (at most MAX_TEMPLATE_BYTES)."""
    try:
        raw = read_capped(path, MAX_TEMPLATE_BYTES)
        if raw is not None:
            return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FlashError(f"cannot read chat template {path}: {e}") from None
    raise FlashError(f"chat template {path} is more than {MAX_TEMPLATE_BYTES >> 20} MiB (a "
                     "template is a few KiB): not a chat template")


def flash_stats_lines(parts) -> list[str]:
    """The --stats table: the FFN's per-token reads, the streamed dense weights, a sparse head."""
    from flashllm.runtime.stats import stats_table
    ffn, weights, head = parts.ffn, parts.weights, parts.head
    lines = [stats_table(ffn.stats()) if ffn is not None else "ffn: dense (no flash I/O)"]
    if weights is not None:
        d = weights.stats()
        lines.append(f"dense weights: {len(d['dense_streamed'])} matrices streamed, "
                     f"{d['dense_bytes_read'] / 2**20:.1f} MiB read")
    if head is not None:
        h = head.stats()
        n = max(1, h["head_tokens"])
        only = f", {h['head_allowed_only']} read all a grammar's allowed rows (unranked)" \
            if h["head_allowed_only"] else ""
        lines.append(f"sparse head: {h['head_rows'] / n:.0f} rows ({h['head_pages'] * 4 / n:.0f} "
                     f"KiB) and {h['head_sketch_bytes'] / n / 2**20:.1f} MiB of sketch read a "
                     f"token, {h['head_fallbacks']} of {h['head_tokens']} read the whole "
                     f"head{only}; sketch {h['head_sketch_s'] * 1e3 / n:.1f} ms, rows "
                     f"{h['head_exact_s'] * 1e3 / n:.1f} ms a token")
    return lines


def flash_json(parts) -> dict:
    """The --stats --json "flash" section: the FFN's counters, the streamed dense weights' and the
    sparse head's."""
    ffn, weights, head = parts.ffn, parts.weights, parts.head
    d = ffn.stats() if ffn is not None else {"ffn": "dense"}
    if weights is not None:
        d = {**d, "dense": {**weights.stats(), **(head.stats() if head is not None else {})}}
    return d


def stats_json(stats, flash: Optional[dict] = None, grammar: Optional[dict] = None) -> str:
    """One JSON object of a generation's counts, times and speeds (and the flash FFN's
    per-token stats under "flash" with --stats, a grammar's counts under "grammar")."""
    import dataclasses
    import json
    extra = ({} if flash is None else {"flash": flash}) | \
        ({} if grammar is None else {"grammar": grammar})
    return json.dumps({**dataclasses.asdict(stats), "prefill_tps": stats.prefill_tps,
                       "decode_tps": stats.decode_tps, **extra})


def turns_json(session) -> str:
    """A chat's turns as one JSON object (--json)."""
    import json
    return json.dumps({"turns": [t.to_dict() for t in session.turns]})
