"""What every runner shares, torch-free: memory figures, the KV budget's errors, and the
engine step around a forward path (copy-on-write, constrained rows' masks, sampling).

Two runners: `runner.ModelRunner` (torch: the GPU, safetensors checkpoints, the reference
forward) and `cpu_runtime.CpuRunner` (numpy and the Rust kernels: GGUF files on the CPU).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Any, Protocol

import numpy as np

from ..constrain.grammar import Masks
from .params import SamplingParams
from .sampler import as_array, logprob_info, prepare, sample, sample_prepared


class _Background:
    """fn(*args) in a thread of its own; `result()` waits for it (and raises what it raised)."""

    def __init__(self, fn, *args):
        import threading
        self._out = self._err = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._out = fn(*args)
        except BaseException as e:   # handed to the caller
            self._err = e

    def result(self):
        self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out


class Launched:
    """A step `step_begin` started: its tokens (host) once known; a device runner's own
    handle adds the ids left on its device (`ids`) and what says they reached the host."""

    def __init__(self, tokens: list | None = None, ids=None, ready=None, host=None):
        self.tokens, self.ids, self.ready, self.host = tokens, ids, ready, host


def _token_id(tok) -> int:
    """A sampled row's token id (a logprobs row's (token, info)); 0 for a row that failed
    (its request ends with the step's results; the placeholder computes nothing it keeps)."""
    if isinstance(tok, tuple):
        tok = tok[0]
    return int(tok) if isinstance(tok, (int, np.integer)) else 0


CPU_KV_MAX_BYTES = 1 << 30       # CPU default budget: min(1 GiB, 25% of available RAM)
CPU_KV_RAM_FRACTION = 0.25


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_default_bytes() -> int:
    """The CPU's KV budget when none is given: min(1 GiB, 25 % of the available RAM)."""
    return min(CPU_KV_MAX_BYTES, int(CPU_KV_RAM_FRACTION * available_ram()))


def rss_bytes() -> int | None:
    """The process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class StepInterrupted(Exception):
    """A long step stopped between two layers because the engine asked it to (an interactive
    prompt arrived behind a document's prefill chunk): nothing was sampled, and the engine
    undoes the step's reservations (Scheduler.undo_step) and plans again."""


class KvBudgetError(ValueError):
    """A KV cache budget this machine cannot hold (or too small for one block)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


class Runner(Protocol):
    """What the engine, the front end and the doors use of a runner; every runner declares
    it (`CpuRunner`, `ModelRunner` through `RunnerBase`; `encoder.EncoderRunner`), so no
    caller probes one with getattr."""

    config: Any                 # ModelConfig (or an encoder's config)
    tokenizer: Any
    model_path: Any
    model_name: str | None      # a name for lists and banners (None: the file's stem)
    served_name: str | None     # the name the store lists it under (`edgepaged pull`), or None
    weights_cache: str | None   # how its laid-out weights came: "hit", "writing", or None
    file_info: dict | None      # format, size, modification time, quantization (model lists)
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_dtype_name: str
    embedding_only: bool        # an embedding model: it answers embeddings only
    keeps_kv: bool              # its blocks hold K/V: read_block / write_block (the disk tier)
    draft: Any                  # a draft model's runner (engine/draft.py), or None
    products: str               # how the weights multiply, for banners
    # a threading.Event the engine sets to stop a long step between two layers (the step
    # raises StepInterrupted), or None where a step cannot be stopped
    interrupt: Any

    def step(self, batch, params, prev_tokens=None, **kw) -> list: ...

    def memory(self) -> dict: ...

    def attach_draft(self, draft) -> None: ...


class RunnerBase:
    """The engine's side of a decoder's runner (`Runner`). A runner sets: config, tokenizer,
    model_path, file_info, block_size, block_bytes, num_blocks, max_model_len, quantized,
    quant_math, kv_dtype_name, and implements `execute`, `copy_blocks`, and
    `read_block(block) -> uint8 bytes` / `write_block(block, bytes)` for the prefix cache's
    disk tier (`read_blocks` may copy several at once)."""

    mask_ms: collections.deque
    draft = None          # a draft model's runner (speculation by a draft: engine/draft.py), or None
    embedding_only = False
    keeps_kv = True
    model_name: str | None = None
    served_name: str | None = None     # the store's name for it (a constructor's `served_name`)
    weights_cache: str | None = None   # "hit" / "writing": its laid-out weights (CpuRunner)
    file_info: dict | None = None
    interrupt = None      # a threading.Event where a step can stop between layers (CpuRunner)
    # a vision model's image side (model/vision.VisionEncoder, from its mmproj file) and the
    # images its prompts hold (model/image_table.ImageTable); None for a text-only model
    vision = None
    images = None

    def attach_vision(self, mmproj, math: str | None = None) -> None:
        """Take images: `mmproj`, the model's vision projector file (llama.cpp's layout).
        `math`: its tower's products, "exact" or "int8" (None: the encoders' choice under
        `--quant-math`: int8 where the CPU has integer kernels, on the CPU runtime)."""
        from .image_table import ImageTable
        from .vision import VisionEncoder
        enc = VisionEncoder(mmproj, math or self._tower_math())
        if enc.width != self.config.hidden_size:
            raise ValueError(f"{enc.path.name} projects images to {enc.width} values, but "
                             f"{getattr(self.model_path, 'name', 'the model')} is {self.config.hidden_size} wide: "
                             "they are not a pair")
        if enc.mrope != bool(getattr(self.config, "rope_sections", None)):
            raise ValueError(f"{enc.path.name} and {getattr(self.model_path, 'name', 'the model')} are not a pair: "
                             + ("the projector's images take multimodal rotary positions (Qwen2.5-VL), the model "
                                "has none" if enc.mrope else "the model's rotary positions are multimodal "
                                "(Qwen2.5-VL), the projector's images are not"))
        self.vision, self.images = enc, ImageTable(self.config.vocab_size, both_ways=enc.both_ways, mrope=enc.mrope)
        self._take_images(self.images)

    def _tower_math(self) -> str:
        """The vision tower's products under `--quant-math`: "auto" is int8 where the integer
        kernels have VNNI; with AVX2 alone they are slower than f32 BLAS on its 1024-row
        products (140-150 against 175-188 GFLOP/s on a Zen 3: bench/RESULTS.md), so exact."""
        settings = getattr(self, "settings", None)
        if settings is None or settings.quant_math == "exact":
            return "exact"
        if settings.quant_math != "auto":
            return settings.quant_math
        from .._native import quant
        return "int8" if quant.info()["int8_isa"] == "avx512-vnni" else "exact"

    def _take_images(self, table) -> None:
        """The forward's embedding takes image ids (>= table.first) from `table`."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    def attach_draft(self, draft) -> None:
        """Speculation by a draft model: `draft`, a runner sharing this one's block numbers
        (`engine.draft.check_pair` checks the pair: at load, and when the engine starts)."""
        self.draft = draft

    def _init_stats(self) -> None:
        self.mask_ms = collections.deque(maxlen=10000)   # constrained steps' mask times

    @property
    def products(self) -> str:
        """How the weights multiply, for banners: "int8 (avx512-vnni)", "exact (avx2)" or
        "exact (avx2, 16 lanes)" (GGUF blocks kept quantized; 16 lanes: AVX-512 F for the
        interleaved formats' decode), "fp32" (dense)."""
        if not self.quantized:
            return self.dense_products
        if self.quant_math == "triton":
            return "GGUF blocks (triton)"
        from .._native import quant
        info = quant.info()
        if self.quant_math == "int8":
            return f"int8 ({info['int8_isa']})"
        return f"{self.quant_math} ({info['isa']}{', 16 lanes' if info.get('exact_lanes') == 16 else ''})"

    def read_blocks(self, blocks) -> list:
        """Several blocks' K/V for the disk tier (a runner may copy them in one gather)."""
        return [self.read_block(int(b)) for b in blocks]

    def rotary_positions(self, positions) -> None:
        """The window policy writes positions past the context (the kernels see only the kept
        blocks, each token rotated at its true position): the rotary tables grow to twice what
        is needed, with the same frequencies (a model whose frequencies depend on the table's
        length, longrope, cannot go past it)."""
        have = self._rotary_size()
        if not len(positions):
            return
        need = int(positions.max() if hasattr(positions, "max") else max(positions)) + 1
        if need <= have:
            return
        if (getattr(self.config, "rope_scaling", None) or {}).get("rope_type") == "longrope":
            raise ValueError(f"position {need - 1} is past this model's rotary tables ({have}): its longrope "
                             "frequencies depend on the context, so it cannot generate past it")
        self.model.build_rotary(max(2 * need, have))

    def memory(self) -> dict:
        """What the model holds: weights, the KV pool (reserved: its size; used: blocks in
        use, passed in by the engine), and the process's resident memory."""
        try:
            weights = self.weight_bytes()
        except Exception:  # noqa: BLE001 - a model without the usual modules: say nothing wrong
            weights = None
        out = {"weights_bytes": weights, "kv_reserved_bytes": self.num_blocks * self.block_bytes,
               "block_bytes": self.block_bytes, "rss_bytes": rss_bytes()}
        if self.weights_cache == "hit":   # mapped: resident as they are first read
            out["weights_mapped"] = True
        if self.draft is not None:     # its weights, and its cache beside each block of the pool
            d = self.draft.memory()
            out["draft_weights_bytes"] = d["weights_bytes"]
            out["kv_reserved_bytes"] += d["kv_reserved_bytes"]
            out["block_bytes"] += d["block_bytes"]
        return out

    def _free_memory(self) -> tuple[int, str]:
        return available_ram(), "available memory"

    def _check_budget(self, kv_bytes: int, path) -> None:
        """KvBudgetError for a budget the device's free memory cannot hold, next to the weights."""
        free, where = self._free_memory()
        weights = path.stat().st_size if path.is_file() else 0
        room = free - weights
        if kv_bytes > room:
            hint = f"at most about {_gib(max(room, 0) * 0.9)}" if room > 2**28 else "a smaller model or more memory"
            raise KvBudgetError(f"{_gib(kv_bytes)} of KV cache does not fit: this machine has {_gib(free)} of "
                                f"{where}, and the weights take about {_gib(weights)} of it (try {hint})")
        if kv_bytes < self.block_bytes:
            raise KvBudgetError(f"{kv_bytes} bytes of KV cache is less than one block of this model "
                                f"({self.block_bytes} bytes; e.g. 256M)")

    def _masks(self, matchers) -> Masks | None:
        t0 = time.perf_counter()
        masks = Masks.compute(matchers, self.config.vocab_size)
        self.mask_ms.append((time.perf_counter() - t0) * 1000)
        return masks

    # a runner whose `step_begin` returns before its device has computed the step (the torch
    # runner on a GPU): the engine plans the next decode step meanwhile (look-ahead decode)
    async_steps = False

    def step_begin(self, batch, params: list[SamplingParams], feed=None) -> "Launched":
        """Start one step of plain rows (no format, history or speculation: the engine's
        look-ahead decode) and return its handle; `step_end(handle)` gives its tokens.
        `feed`: (an earlier step's handle, rows): row i's input token is that step's token of
        row rows[i] (batch.input_ids holds placeholders there): a step planned before the
        last one's tokens were known. Here: the whole step at once (the host's sampler)."""
        if feed is not None:
            earlier, rows = feed
            got = self.step_end(earlier)
            batch.input_ids = np.array([_token_id(got[j]) for j in rows], dtype=np.int64)
        return Launched(self.step(batch, params))

    def step_end(self, launched: "Launched") -> list:
        """The tokens of a step `step_begin` started (waits for the device where it must)."""
        return launched.tokens

    def step(self, batch, params: list[SamplingParams], prev_tokens=None, matchers=None, outputs=None,
             embeds=None, spec=None) -> list:
        """One engine step: the batch's copy-on-write copies, the forward, one sampled token
        per logits row. `batch` has the scheduler's arrays (input_ids, positions,
        query_start_loc, seq_lens, block_tables, slot_mapping, copies, logits_indices);
        params[i] / prev_tokens[i] (the sequence's tokens so far) / matchers[i] (a constrained
        output's llguidance matcher, or None) / outputs[i] (the answer's tokens, for presence and
        frequency penalties) belong to logits row i. The constrained rows' token masks are
        computed in a thread of their own while the forward runs. A row that asked for
        logprobs gets (token, info) instead of its token (sampler.logprob_info)."""
        if len(batch.copies):
            self.copy_blocks(batch.copies)
        for block, data in getattr(batch, "loads", ()):     # the disk tier's blocks, as they were computed
            self.write_block(block, data)
        meta = dict(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                    block_tables=batch.block_tables, slot_mapping=batch.slot_mapping)
        if getattr(batch, "prompt", None) is not None:
            meta["prompt"] = batch.prompt
        positions = batch.positions
        if getattr(batch, "rope_positions", None) is not None:     # M-RoPE (Qwen2.5-VL's images)
            positions = batch.rope_positions
            if batch.mrope is not None:
                meta["mrope"] = batch.mrope
        masks = None
        if matchers is not None and any(m is not None for m in matchers):
            masks = _Background(self._masks, matchers)
        try:
            raw = self.execute(batch.input_ids, positions, meta, batch.logits_indices)
            if not spec and not (embeds is not None and any(embeds)):
                tokens = self.sample_where_computed(raw, params, prev_tokens, outputs, masks)
                if tokens is not None:
                    return tokens            # B token ids cross to the host, not B x vocab logits
            every = as_array(raw)
        except StepInterrupted:
            if masks is not None:        # its matchers are the next step's again: let it finish
                try:
                    masks.result()
                except Exception:  # noqa: BLE001 - the step is undone anyway
                    pass
            raise
        logits = every[:len(params)] if spec else every
        if embeds is not None and any(embeds):
            # a request for an embedding: its row's final-norm hidden state (last-token pooling),
            # not a sampled token; the other rows sample as ever
            out = self._step_embeds(logits, params, prev_tokens, matchers, outputs, embeds, masks)
        else:
            out = self._sample_all(logits, params, prev_tokens, outputs, masks)
        if spec:
            # speculation (engine/speculate.py): spec[i] = (drafts, the rows of the drafts' logits,
            # past the sampled rows); row i's answer is the list of tokens kept
            from .sampler import verify
            for i, (drafts, rows, *more) in spec.items():
                m = matchers[i] if matchers is not None else None
                drawn = out[i] if isinstance(out[i], (int, np.integer)) else None   # row 0, drawn by the plain pass
                try:
                    out[i] = verify(every[[i] + list(rows)], drafts, params[i], prev_tokens[i],
                                    outputs[i] if outputs is not None else None, matcher=m,
                                    stops=(set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else
                                           set(self.tokenizer.stop_token_ids))) if m else (),
                                    vocab=self.config.vocab_size, first=drawn, forced=more[0] if more else 0,
                                    have=more[1] if len(more) > 1 else None)
                except Exception as e:     # that row alone fails
                    out[i] = e
        return out

    def sample_where_computed(self, logits, params, prev_tokens, outputs, masks=None) -> list | None:
        """A step's tokens drawn where its logits are (a GPU runner's device; `masks`: the
        format masks being computed, `_Background`), or None: the host's sampler draws them
        (the default; a seeded row, logprobs, a draft to check, an embedding)."""
        return None

    def _step_embeds(self, logits, params, prev_tokens, matchers, outputs, embeds, masks) -> list:
        hidden = np.asarray(self.last_hidden(), dtype=np.float32)
        rows = [i for i, e in enumerate(embeds) if not e]
        out: list = [hidden[i].copy() if e else None for i, e in enumerate(embeds)]
        if rows:
            sub = self.step_rows(logits, rows, params, prev_tokens, matchers, outputs, masks)
            for i, tok in zip(rows, sub):
                out[i] = tok
        return out

    def step_rows(self, logits, rows, params, prev_tokens, matchers, outputs, masks) -> list:
        """Sample the logits rows `rows` only (beside embedding rows)."""
        if masks is not None:
            masks = masks.result()
            masks.apply(logits)
            masks = None
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]   # noqa: E731
        return self._sample_all(np.ascontiguousarray(logits[rows]), pick(params), pick(prev_tokens), pick(outputs),
                                None)

    def _sample_all(self, logits, params, prev_tokens, outputs, masks) -> list:
        if masks is not None:
            masks = masks.result()
            masks.apply(logits)
        if len(logits) == 0:
            return []
        try:
            if any(p.logprobs is not None for p in params):
                logits = prepare(logits, params, prev_tokens, outputs)
                tokens = sample_prepared(logits, params, prev_tokens)
                infos = logprob_info(logits, tokens, params)
                return [t if info is None else (t, info) for t, info in zip(tokens.tolist(), infos)]
            return sample(logits, params, prev_tokens, outputs).tolist()
        except Exception as e:
            if len(params) == 1:     # that row's failure, reported as its own
                return [e]
        # one row's sampling failed: sample row by row, so the failure stays that row's
        out: list = []
        for i, p in enumerate(params):
            try:
                out.append(int(sample(logits[i:i + 1], [p], None if prev_tokens is None else [prev_tokens[i]],
                                      None if outputs is None else [outputs[i]])[0]))
            except Exception as e:
                out.append(e)
        return out


RUNTIMES = ("auto", "cpu", "torch")
