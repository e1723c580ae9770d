"""The model runner: owns the paged KV tensors and its own view of each sequence; runs a step.

It is told everything by the ``SchedulerOutput`` (``engine.scheduling.output``): a sequence's
token ids, block table, sampling params, generator seed, adapter slot and images arrive once
in a ``NewSeq``; each step brings its new block ids, copy-on-write replacements and image spans.
It never reads a ``Sequence``, a request or a manager, and answers with a ``ModelRunnerOutput``:
the sampled token ids (and logprobs) per sequence, appended to its own token lists as well.

Per step: swap-out copies, swap-in copies, copy-on-write copies, then one forward pass over the
flattened tokens of every scheduled sequence (prefill chunks and decodes mixed), with image
features spliced in at image-placeholder rows, then logits for the sequences that sample, then
the sampler. A sequence whose part of the forward pass or of the sampling raises fails alone
(``engine.runner.step_isolation``).

Speculative decoding (``engine.spec_decode``): a sequence scheduled with proposals computes
its last token and the proposals in one query of ``1 + k`` positions, the target's token is
sampled at each and the agreeing prefix is kept (``engine.spec_decode.verify``). The blocks past
it are the KV cache manager's to give back (``KVCacheManager.trim``, in the scheduler's
``update_from_output``): the runner cuts its table to what the manager kept when the step's
``SchedulerOutput.kv_trims`` comes back (:meth:`ModelRunner.apply_kv_trims`). After sampling,
the proposer offers the next step's proposals. A draft model (``engine.spec_decode.draft``)
is handed each speculating sequence's tokens and table (``DraftInput``), nothing else.

CUDA graphs (``engine.runner.cuda_graphs``): when :attr:`ModelRunner.decode_graphs` is set, a
pure-decode step (one query token per sequence, no image, no proposal, within the largest
bucket) copies its inputs into the graphs' static buffers and replays its bucket's graph (or,
built with ``capture=False``, runs the same padded batch eagerly); logits and sampling follow
from the real rows as for any step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from loraplex.engine.attention import AttentionBackend
from loraplex.engine.attention.metadata import step_inputs
from loraplex.engine.kv_cache.block_table import BlockTable
from loraplex.engine.kv_cache.profile import pool_zeros
from loraplex.engine.lora.backend import LoRABackend
from loraplex.engine.request import ImageInput
from loraplex.engine.runner.compiled_step import CompiledStep
from loraplex.engine.runner.cuda_graphs import DecodeGraphRunner
from loraplex.engine.runner.image_splice import mrope_positions, splice_rows, with_image_bounds
from loraplex.engine.runner.step_isolation import execute_isolating, sample_rows_isolating
from loraplex.engine.runner.vision_cache import VisionCache
from loraplex.engine.sampling.logprobs import PromptLogprob, prompt_logprobs
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.penalties import TokenHistory, needs_history
from loraplex.engine.sampling.sampler import Sampler, make_generator
from loraplex.engine.scheduling.output import (
    ModelRunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from loraplex.engine.spec_decode import NgramProposer, accepted_prefix
from loraplex.engine.spec_decode.draft import DraftInput, DraftProposer
from loraplex.engine.spec_decode.verify import rewind_generator
from loraplex.engine.structured_output.grammar import apply_token_bitmasks

logger = logging.getLogger(__name__)


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


@dataclass
class _RunnerSeq:
    """What the runner knows of one sequence."""

    token_ids: list[int]
    num_prompt_tokens: int
    table: BlockTable
    sampling: SamplingParams
    images: list[ImageInput]
    cache_salt: str | None
    prompt_tensor: torch.Tensor | None = None  # [P] int64, made once for repetition_penalty
    rope: tuple[torch.Tensor, int] | None = None  # M-RoPE: prompt positions [3, P], delta


class ModelRunner:
    """Runs the model over the paged KV cache and samples.

    Args:
        model: A model from ``engine.models`` (``forward``, ``embed_tokens``,
            ``compute_logits``; the native LLaVA also ``encode_images`` (a batch), a
            transformers vision-language model ``encode_image`` (one image) and maybe
            ``bidirectional_image_spans``).
        num_kv_blocks: Device blocks per layer.
        block_size: Tokens per block.
        backend: The attention backend.
        device: Where the model and caches live.
        dtype: KV cache dtype (the model's).
        sampler: The sampler (its shared generator serves unseeded sequences).
        num_cpu_blocks: Blocks of the CPU swap pool (0: no swap pool).
        vision_cache: Cache of image encodings, None to always encode.
        lora_backend: The LoRA backend of the model's LoRA layers (``engine.lora``), whose
            step metadata the runner updates before each forward pass; None when the model
            serves no adapters.
        proposer: Speculative decoding's n-gram proposer, None for none.
        draft: Speculative decoding's draft model (``engine.spec_decode.draft``), None for
            none.
        num_speculative_tokens: Most proposals asked of the proposer per sequence and step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_kv_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        sampler: Sampler,
        num_cpu_blocks: int = 0,
        vision_cache: VisionCache | None = None,
        lora_backend: LoRABackend | None = None,
        proposer: NgramProposer | None = None,
        num_speculative_tokens: int = 0,
        draft: DraftProposer | None = None,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        self.vision_cache = vision_cache
        self.lora_backend = lora_backend
        self.num_images_encoded = 0
        self.last_forward_seconds = 0.0  # model forward + logits of the last step
        # Pure-decode steps through CUDA graphs (or padded eagerly); set after the KV caches
        # exist (engine.runner.cuda_graphs.build_decode_graphs); None: every step eager.
        self.decode_graphs: DecodeGraphRunner | None = None
        # The model's forward compiled by inductor (engine.runner.compiled_step; CPU), used for
        # every step it accepts; None: the eager forward.
        self.compiled_step: CompiledStep | None = None
        self.seqs: dict[str, _RunnerSeq] = {}
        # The step's prompt logprobs, by sequence (filled by forward, read by execute).
        self._prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = {}
        self.generators: dict[str, torch.Generator] = {}
        shape = (num_kv_blocks, block_size, model.num_kv_heads, model.head_dim)
        # One (K, V) pair of [num_blocks, block_size, num_kv_heads, head_dim] per layer.
        self.kv_caches = [
            (pool_zeros(shape, dtype, device), pool_zeros(shape, dtype, device))
            for _ in range(model.num_layers)
        ]
        cpu_shape = (num_cpu_blocks, block_size, model.num_kv_heads, model.head_dim)
        pin = device.type == "cuda"
        self.cpu_caches = (
            [
                (
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                )
                for _ in range(model.num_layers)
            ]
            if num_cpu_blocks
            else []
        )

    # --------------------------------------------------------------------------- state
    def update_states(self, sched: SchedulerOutput) -> None:
        """Apply what the step says about sequences: drops, new ones, new blocks, copies."""
        for seq_id in sched.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            self.generators.pop(seq_id, None)
            self._drop_spec(seq_id)
        for seq_id in sched.dropped_seq_ids:  # preempted: a resumed one comes back whole
            self.seqs.pop(seq_id, None)
            self._drop_spec(seq_id)
        for new in sched.new_seqs:
            self.seqs[new.seq_id] = _RunnerSeq(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                table=BlockTable(self.block_size, new.block_ids),
                sampling=new.sampling,
                images=new.images,
                cache_salt=new.cache_salt,
            )
            if new.seed is not None and new.seq_id not in self.generators:
                self.generators[new.seq_id] = make_generator(new.seed, self.device)
        for item in sched.scheduled:
            table = self.seqs[item.seq_id].table
            for logical, block in item.copies:
                table.block_ids[logical] = block
            table.append(item.new_block_ids)

    def apply_kv_trims(self, kv_trims: dict[str, int]) -> None:
        """Cut block tables to the blocks the KV cache manager kept after verification.

        Args:
            kv_trims: ``seq_id -> blocks kept`` (``SchedulerOutput.kv_trims``, the KV cache
                manager's trim of rejected proposals' blocks); unknown ids are ignored.
        """
        for seq_id, num_blocks in kv_trims.items():
            st = self.seqs.get(seq_id)
            if st is not None:
                del st.table.block_ids[num_blocks:]

    def _drop_spec(self, seq_id: str) -> None:
        for proposer in (self.proposer, self.draft):
            if proposer is not None:
                proposer.drop(seq_id)

    # ------------------------------------------------------------------------ KV copies
    def _copy_blocks(self, pairs, src_caches, dst_caches) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
            s_idx = src.to(sk.device)
            d_idx = dst.to(dk.device)
            dk.index_copy_(0, d_idx, sk.index_select(0, s_idx).to(dk.device))
            dv.index_copy_(0, d_idx, sv.index_select(0, s_idx).to(dv.device))

    def apply_copies(self, sched: SchedulerOutput) -> None:
        """Swap-outs, then swap-ins, then copy-on-write copies (before the forward pass)."""
        self._copy_blocks(sched.swap_out, self.kv_caches, self.cpu_caches)
        self._copy_blocks(sched.swap_in, self.cpu_caches, self.kv_caches)
        self._copy_blocks(sched.block_copies, self.kv_caches, self.kv_caches)
        if self.draft is not None:  # same block ids; a swapped sequence redoes its draft KV
            self._copy_blocks(sched.block_copies, self.draft.kv_caches, self.draft.kv_caches)

    # --------------------------------------------------------------------------- step
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: state updates, copies, the forward pass, sampling.

        Returns:
            The sampled tokens per sampling sequence (one per ``fork_ids`` entry for a fork),
            their logprobs where asked, and the sequences whose part failed.

        Raises:
            Exception: what a copy raised (no sequence to blame: the engine is broken).
        """
        self.update_states(sched)
        self.apply_copies(sched)
        result = ModelRunnerOutput()
        if not sched.scheduled:
            return result
        items = sched.scheduled
        if self.draft is not None:  # the draft model's proposals, before the target's forward
            inputs = {
                item.seq_id: DraftInput(
                    self.seqs[item.seq_id].token_ids, self.seqs[item.seq_id].table
                )
                for item in items
                if item.num_draft_tokens
            }
            items = self.draft.fill(items, inputs)
        self._prompt_logprobs = {}
        step = execute_isolating(self.forward, items)
        for item, exc in step.culprits:
            logger.error("%s failed in the forward pass", item.seq_id, exc_info=exc)
            result.failed[item.seq_id] = "the forward pass"
        for item in step.kept:
            if item.seq_id in self._prompt_logprobs:
                result.prompt_logprobs[item.seq_id] = self._prompt_logprobs[item.seq_id]
        self._prompt_logprobs = {}
        result.forward_seconds = self.last_forward_seconds
        sampling = [item for item in step.kept if item.sample]
        if not sampling:
            return result
        self._sample(sampling, step.logits_of, result)
        return result

    def _sample(self, items: list[ScheduledSeq], logits_of, result: ModelRunnerOutput) -> None:
        """Sample every sampling sequence's token(s); a row that fails fails its sequence.

        A fork samples one row per child; a speculating sequence one row per verified
        position, each seeing the proposals before it as output (penalties, ``min_tokens``).
        """
        rows: list[torch.Tensor] = []
        owners: list[tuple[str, str]] = []  # (sequence, generator id) per row
        positions: list[int] = []  # the row's position among a speculating sequence's
        masks: list[bytes | None] = []  # structured output: the row's token bitmask
        for item in items:
            block = logits_of(item)
            gen_ids = [item.seq_id] * block.shape[0] if item.spec_token_ids else None
            row_masks = [item.token_bitmask, *item.spec_bitmasks]
            for i, gen_id in enumerate(gen_ids or item.fork_ids or (item.seq_id,)):
                rows.append(block[i if gen_ids else 0])
                owners.append((item.seq_id, gen_id))
                positions.append(i if gen_ids else 0)
                masks.append(row_masks[positions[-1]] if item.token_bitmask is not None else None)
        logits = torch.stack(rows)
        constrained = [r for r, mask in enumerate(masks) if mask is not None]
        for r in apply_token_bitmasks(logits, constrained, [masks[r] for r in constrained]):
            logger.error("%s: its grammar allows no token", owners[r][0])
            result.failed[owners[r][0]] = "structured output"
        by_id = {item.seq_id: item for item in items}
        params = [self.seqs[seq_id].sampling for seq_id, _ in owners]
        histories = [
            self._history(self.seqs[seq_id], by_id[seq_id].spec_token_ids[: positions[r]])
            if needs_history(params[r])
            else None
            for r, (seq_id, _) in enumerate(owners)
        ]
        generators = []
        for seq_id, gen_id in owners:
            gen = self.generators.get(gen_id)
            if gen is None and gen_id != seq_id:  # a fork child: seeded from the request's seed
                seed = self.seqs[seq_id].sampling.seed
                if seed is not None:
                    index = by_id[seq_id].fork_ids.index(gen_id)
                    gen = self.generators[gen_id] = make_generator(seed + index, self.device)
            generators.append(gen)
        rewinds = {  # speculating seeded sequences: their generator's state before the step
            item.seq_id: gen.get_state()
            for item in items
            if item.spec_token_ids
            and not self.seqs[item.seq_id].sampling.greedy
            and (gen := self.generators.get(item.seq_id)) is not None
        }

        def sample(which: list[int]):
            return self.sampler(
                logits if len(which) == len(owners) else logits[which],
                [params[r] for r in which],
                [generators[r] for r in which],
                histories=[histories[r] for r in which],
            )

        results, failed_rows = sample_rows_isolating(sample, len(owners))
        for r, exc in failed_rows.items():
            logger.error("%s failed in sampling", owners[r][0], exc_info=exc)
            result.failed[owners[r][0]] = "sampling"
        logprobs: dict[str, list] = {}
        for (seq_id, _), res in zip(owners, results, strict=True):
            if seq_id in result.failed:
                continue
            token, logprob, _, top = res
            result.sampled.setdefault(seq_id, []).append(token)
            logprobs.setdefault(seq_id, []).append((logprob, top))
        for seq_id, tokens in result.sampled.items():
            item, st = by_id[seq_id], self.seqs[seq_id]
            if item.num_spec_tokens:  # drafted proposals may be missing (undrafted)
                if not item.spec_token_ids:
                    result.undrafted.add(seq_id)
                kept = accepted_prefix(item.spec_token_ids, tokens) + 1
                del tokens[kept:]
                del logprobs[seq_id][kept:]
                if seq_id in rewinds:
                    rewind_generator(self.generators[seq_id], rewinds[seq_id], kept,
                                     logits.shape[1])  # fmt: skip
                st.token_ids.extend(tokens)  # the table is cut by apply_kv_trims
                if self.draft is not None:
                    self.draft.verified(seq_id, item.start, len(item.spec_token_ids), kept)
            else:
                st.token_ids.append(tokens[0])  # a fork child gets its own later
            if st.sampling.logprobs is not None:
                result.logprobs[seq_id] = logprobs[seq_id]
            if self.proposer is not None and not item.fork_ids:
                result.spec_token_ids[seq_id] = self.proposer.propose(
                    seq_id, st.token_ids, self.num_speculative_tokens
                )

    def _history(self, seq: _RunnerSeq, proposals: list[int] | None = None) -> TokenHistory:
        """A sequence's tokens for penalties, followed by ``proposals`` (speculative rows).

        Its prompt becomes a tensor once, so a long prompt is not converted at every step.
        """
        if seq.sampling.repetition_penalty != 1.0 and seq.prompt_tensor is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            seq.prompt_tensor = torch.tensor(prompt, dtype=torch.long, device=self.device)
        tokens = seq.token_ids + proposals if proposals else seq.token_ids
        return TokenHistory(tokens, seq.num_prompt_tokens, seq.prompt_tensor)

    @torch.inference_mode()
    def forward(self, items: list[ScheduledSeq]) -> torch.Tensor | None:
        """One forward pass over ``items``; ``[num sample rows, vocab]`` float32 logits.

        Returns:
            ``item.num_sample_rows`` rows per item (its last position, or the ``1 + k`` of a
            speculating one), in order; None when none samples. The prompt logprobs of items
            scheduled with ``prompt_logprobs`` go to ``self._prompt_logprobs``
            (:meth:`_prompt_logprobs_of`).
        """
        wants_prompt = any(item.prompt_logprobs for item in items)
        if (
            self.decode_graphs is not None
            and not wants_prompt
            and self.decode_graphs.accepts(items)
        ):
            return self._forward_decode_graph(items)
        chunks = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[str, int, int, int]] = []  # (seq, first row, start, count)
        row = 0
        for item in items:
            st = self.seqs[item.seq_id]
            start, end = item.start, item.start + item.num_new_tokens
            # The computed tokens, then the proposals (in lookahead slots) of a speculating one.
            tokens = st.token_ids[start : end - len(item.spec_token_ids)] + item.spec_token_ids
            chunks.append((tokens, start, st.table))
            if item.prompt_logprobs:  # positions before the prompt's last token
                count = min(end, st.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_rows.append((item.seq_id, row, start, count))
            row += item.num_new_tokens
            sample_rows.extend(range(row - item.num_sample_rows, row))
        inputs = step_inputs(chunks, self.device)
        if getattr(self.model, "bidirectional_image_spans", False):  # an image sees itself whole
            inputs = with_image_bounds(inputs, [
                (q0, [(s, self.seqs[item.seq_id].images[s.image].placeholder)
                      for s in item.image_spans])
                for item, q0 in zip(items, inputs.query_start, strict=False)
            ])  # fmt: skip
        embeds, extra = self._embed_with_images(inputs.input_ids, items, inputs.query_start)
        positions = inputs.positions
        if getattr(self.model, "mrope", False):  # [3, T] rotary positions (Qwen2-VL family)
            for item in items:  # a sequence's prompt positions, once (here: a failure is its own)
                st = self.seqs[item.seq_id]
                if st.images and st.rope is None:
                    grids = [im.inputs.get("image_grid_thw") for im in st.images]
                    prompt = st.token_ids[: st.num_prompt_tokens]
                    st.rope = self.model.rope_positions(prompt, grids)
            positions = mrope_positions(inputs, [
                (q0, item.num_new_tokens, self.seqs[item.seq_id].rope)
                for item, q0 in zip(items, inputs.query_start, strict=False)
            ])  # fmt: skip
        self._set_lora(items)
        t0 = time.perf_counter()
        forward = self.model
        compiled = self.compiled_step
        if compiled is not None and compiled.accepts(len(inputs.input_ids), positions, extra):
            forward = compiled
        hidden = forward(
            None if embeds is not None else inputs.input_ids,
            positions,
            self.kv_caches,
            inputs.metadata,
            self.backend,
            inputs_embeds=embeds,
            **extra,
        )
        logits = None
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
        if prompt_rows:
            self._prompt_logprobs_of(hidden, prompt_rows)
        self._sync()
        self.last_forward_seconds = time.perf_counter() - t0
        return logits

    def _prompt_logprobs_of(
        self, hidden: torch.Tensor, prompt_rows: list[tuple[str, int, int, int]]
    ) -> None:
        """The prompt logprobs of a step's prefill chunks that ask for them.

        Only these rows go through the LM head (a normal prefill computes the logits of its
        last position alone), a block of rows at a time
        (``engine.sampling.logprobs.prompt_logprobs``): memory is bounded by the block, the
        work by the chunked-prefill budget.

        Args:
            hidden: ``[T, hidden]`` the step's final hidden states.
            prompt_rows: ``(seq_id, first row in hidden, first position, count)``: rows
                ``first .. first + count`` hold positions ``start .. start + count``, whose
                logits give prompt tokens ``start + 1 .. start + count``.
        """
        for seq_id, first, start, count in prompt_rows:
            st = self.seqs[seq_id]
            targets = st.token_ids[start + 1 : start + 1 + count]
            entries = prompt_logprobs(
                hidden[first : first + count],
                targets,
                st.sampling.prompt_logprobs or 0,
                self.model.compute_logits,
            )
            self._prompt_logprobs[seq_id] = (start + 1, entries)

    def _forward_decode_graph(self, items: list[ScheduledSeq]) -> torch.Tensor | None:
        """:meth:`forward` of a pure-decode step through :attr:`decode_graphs`.

        Row ``i`` of the bucket is ``items[i]``'s one query; the padding rows past them are
        dropped before the logits.
        """
        graphs = self.decode_graphs
        assert graphs is not None
        token_ids, positions, tables, lora_slots = [], [], [], []
        for item in items:
            st = self.seqs[item.seq_id]
            token_ids.append(st.token_ids[item.start])
            positions.append(item.start)
            tables.append(st.table.block_ids)
            lora_slots.append(item.lora_slot)
        size = graphs.prepare(token_ids, positions, tables, lora_slots)
        t0 = time.perf_counter()
        hidden = graphs.run(size, len(items))
        sample_rows = [i for i, item in enumerate(items) if item.sample]
        logits = None
        if sample_rows:
            rows = hidden if len(sample_rows) == len(items) else hidden[sample_rows]
            logits = self.model.compute_logits(rows).float()
        self._sync()
        self.last_forward_seconds = time.perf_counter() - t0
        return logits

    def _set_lora(self, items: list[ScheduledSeq]) -> None:
        """Tell the LoRA layers which slot each of the step's tokens uses (-1: base)."""
        if self.lora_backend is None:
            return
        token_slots: list[int] = []
        for item in items:
            token_slots.extend([item.lora_slot] * item.num_new_tokens)
        if any(s >= 0 for s in token_slots):
            self.lora_backend.update_metadata(token_slots, self.device)
        else:
            self.lora_backend.clear()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _embed_with_images(
        self, ids: torch.Tensor, items: list[ScheduledSeq], query_start: list[int]
    ) -> tuple[torch.Tensor | None, dict]:
        """Token embeddings with image features at the image tokens this step computes.

        Each image's features go to its span's image tokens in order (``image_splice``).
        Features wider than the embeddings (Qwen3-VL: the first ``hidden`` columns are the
        input embedding, the rest its deepstack features) leave their other columns in a
        ``[T, extra]`` tensor, with a ``[T]`` mask of the rows that hold them.

        Returns:
            ``(embeds or None when no image is in the step, extra forward arguments)``:
            ``{"deepstack": (mask, extra)}`` for wider features, else ``{}``.
        """
        spans = []  # (row in the step, sequence, image, first span position, count)
        for item, q0 in zip(items, query_start, strict=False):
            st = self.seqs[item.seq_id]
            for span in item.image_spans:
                spans.append((q0 + span.row, st, st.images[span.image], span.first, span.count))
        if not spans:
            return None, {}
        features = self._image_features([(st.cache_salt, image) for _, st, image, _, _ in spans])
        embeds = self.model.embed_tokens(ids)
        hidden = embeds.shape[1]
        width = max(f.shape[1] for f in features.values())
        extra = embeds.new_zeros(embeds.shape[0], width - hidden) if width > hidden else None
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
        token = getattr(self.model, "image_token_id", None)
        for row, st, image, first, count in spans:
            feats = features[(st.cache_salt, image.key)]
            rows, start = splice_rows(
                st.token_ids, image.placeholder, first, count, token, feats.shape[0]
            )
            if rows is None:
                at = torch.arange(row, row + count, device=embeds.device)
            else:
                at = torch.tensor(rows, dtype=torch.long, device=embeds.device) + row
            taken = feats[start : start + at.shape[0]].to(embeds.dtype)
            embeds[at] = taken[:, :hidden]
            if extra is not None:
                extra[at] = taken[:, hidden:]
                mask[at] = True
        return embeds, ({"deepstack": (mask, extra)} if extra is not None else {})

    def _image_features(self, wanted) -> dict[tuple[str | None, str], torch.Tensor]:
        """Features of each (salt, image), from the vision cache or encoded in one batch."""
        found: dict[tuple[str | None, str], torch.Tensor] = {}
        missing = {}
        for salt, image in wanted:
            k = (salt, image.key)
            if k in found or k in missing:
                continue
            cached = self.vision_cache.get(salt, image.key) if self.vision_cache else None
            if cached is not None:
                found[k] = cached
            else:
                missing[k] = image
        if missing and hasattr(self.model, "encode_image"):  # one image at a time, any shape
            encoded = [
                self.model.encode_image(im.pixel_values, im.inputs) for im in missing.values()
            ]
        elif missing:
            pixels = torch.stack([im.pixel_values for im in missing.values()]).to(
                device=self.device, dtype=self.dtype
            )
            encoded = self.model.encode_images(pixels)  # [N, num_image_tokens, hidden]
        if missing:
            self.num_images_encoded += len(missing)
            for (salt, key), feats in zip(missing, encoded, strict=True):
                found[(salt, key)] = feats
                if self.vision_cache is not None:
                    self.vision_cache.put(salt, key, feats)
        return found
