"""The model runner: owns the paged KV tensors and turns a scheduled step into logits.

Per step: swap-out copies, swap-in copies, copy-on-write copies, then one forward pass over the
flattened tokens of every scheduled sequence (prefill chunks and decodes mixed), with image
features spliced in at image-placeholder positions, then logits for the sequences that sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_profile import pool_zeros
from loraplex.engine.lora import LoRAStepContext
from loraplex.engine.scheduler import ScheduledSeq, SchedulerOutput
from loraplex.engine.vision_cache import VisionCache


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        model: A model from ``engine.models`` (``forward``, ``embed_tokens``,
            ``compute_logits``; LLaVA also ``encode_images`` and ``image_token_id``).
        num_kv_blocks: Device blocks per layer.
        block_size: Tokens per block.
        backend: The attention backend.
        device: Where the model and caches live.
        dtype: KV cache dtype (the model's).
        num_cpu_blocks: Blocks of the CPU swap pool (0: no swap pool).
        vision_cache: Cache of image encodings, None to always encode.
        lora_context: The step context of the model's LoRA layers (``engine.lora``), None
            when the model serves no adapters.
        lora_slot_of: ``adapter digest -> device slot`` (the LoRA manager's).
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
        num_cpu_blocks: int = 0,
        vision_cache: VisionCache | None = None,
        lora_context: LoRAStepContext | None = None,
        lora_slot_of: Callable[[str], int | None] | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.vision_cache = vision_cache
        self.lora_context = lora_context
        if lora_context is not None:  # the triton backend brings the Triton LoRA kernels
            lora_context.use_triton = backend.name == "triton"
        self.lora_slot_of = lora_slot_of
        self.num_images_encoded = 0
        self.last_forward_seconds = 0.0  # model forward + logits of the last step
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

    # -------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor | None:
        """Run one step.

        Returns:
            ``[num_sampling_seqs, vocab]`` float32 logits, one row per scheduled sequence with
            ``sample`` set, in batch order; None when no sequence samples this step.
        """
        self.apply_copies(sched)
        if not sched.scheduled:
            return None
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for item in sched.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            table = kv.get_block_ids(seq.seq_id)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            tables.append(table)
            if item.sample:
                sample_rows.append(query_start[-1] - 1)
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(
                [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            max_query_len=max(s.num_new_tokens for s in sched.scheduled),
            max_seq_len=max(seq_lens),
            num_decode_tokens=sum(1 for s in sched.scheduled if s.num_new_tokens == 1),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        embeds = self._embed_with_images(ids, sched.scheduled, query_start)
        self._set_lora(sched.scheduled)
        t0 = time.perf_counter()
        hidden = self.model(
            None if embeds is not None else ids,
            pos,
            self.kv_caches,
            meta,
            self.backend,
            inputs_embeds=embeds,
        )
        if not sample_rows:
            self._sync()
            self.last_forward_seconds = time.perf_counter() - t0
            return None
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
        self._sync()
        self.last_forward_seconds = time.perf_counter() - t0
        return logits

    def _set_lora(self, scheduled: list[ScheduledSeq]) -> None:
        """Tell the LoRA layers which slot each of the step's tokens uses (-1: base)."""
        if self.lora_context is None:
            return
        slots: list[int] = []
        for item in scheduled:
            digest = item.seq.request.lora_digest
            slot = -1
            if digest is not None:
                slot = self.lora_slot_of(digest)
                if slot is None:  # the scheduler acquired it: a bug if it is not resident
                    raise RuntimeError(f"adapter {digest} is not resident in a device slot")
            slots.extend([slot] * item.num_new_tokens)
        if any(s >= 0 for s in slots):
            self.lora_context.set_token_slots(slots, self.device)
        else:
            self.lora_context.clear()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _embed_with_images(
        self, ids: torch.Tensor, scheduled: list[ScheduledSeq], query_start: list[int]
    ) -> torch.Tensor | None:
        """Token embeddings with image features at the placeholder rows this step computes."""
        spans = []  # (row offset in the step, image, first feature row, count)
        for item, q0 in zip(scheduled, query_start, strict=False):
            start, end = item.start, item.start + item.num_new_tokens
            for image in item.seq.request.images:
                ph = image.placeholder
                lo, hi = max(start, ph.offset), min(end, ph.end)
                if lo < hi:
                    spans.append(
                        (
                            q0 + lo - start,
                            item.seq.request.cache_salt,
                            image,
                            lo - ph.offset,
                            hi - lo,
                        )
                    )
        if not spans:
            return None
        features = self._image_features([(salt, image) for _, salt, image, _, _ in spans])
        embeds = self.model.embed_tokens(ids)
        for row, salt, image, first, count in spans:
            feats = features[(salt, image.key)]
            embeds[row : row + count] = feats[first : first + count].to(embeds.dtype)
        return embeds

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
        if missing:
            pixels = torch.stack([im.pixel_values for im in missing.values()]).to(
                device=self.device, dtype=self.dtype
            )
            encoded = self.model.encode_images(pixels)  # [N, num_image_tokens, hidden]
            self.num_images_encoded += len(missing)
            for (salt, key), feats in zip(missing, encoded, strict=True):
                found[(salt, key)] = feats
                if self.vision_cache is not None:
                    self.vision_cache.put(salt, key, feats)
        return found
