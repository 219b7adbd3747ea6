"""Suites: the representative input of every shape bucket, by op and bucket name (suite
``dsv4``: spec §8 shapes), and the shape facts the pruning rules read of them."""

import dataclasses
import math
from typing import Callable, Dict


@dataclasses.dataclass(frozen=True)
class GatherShape:
    reqs: int
    rows: int  # gathered rows per request
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"gather {self.reqs} x {self.rows} rows (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class InsertShape:
    rows: int
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"insert {self.rows} rows (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class GlobalTopkShape:
    tokens: int
    k: int
    reqs: int
    max_blocks: int
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"global top-k {self.tokens} tokens x {self.k} (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class CombineShape:
    prefix: tuple
    q_len: tuple
    compress_ratio: int
    k: int
    topk: int
    window: int = 128

    @property
    def name(self) -> str:
        return (f"combine top-k {sum(self.q_len)} tokens, {len(self.q_len)} requests, "
                f"cr {self.compress_ratio}, top-k {self.topk} + window {self.window}")


def decode_tiles(rep, block_tokens: int) -> int:
    return math.ceil(rep.window / block_tokens) + math.ceil(rep.extra_topk / block_tokens)


def _dsv4_suite() -> dict:
    """Representative inputs of the DSv4 buckets (spec §8), by op and bucket name."""
    from ..bench import DecodeShape, PrefillShape

    decode = {}
    batches = {64: {"ctas1_16": 8, "ctas17_33": 32, "ctas34_66": 64, "ctas67_up": 128},
               128: {"ctas1_16": 8, "ctas17_33": 16, "ctas34_66": 32, "ctas67_up": 128}}
    for h, by_range in batches.items():
        for kind in ("swa", "c4a", "c128a"):
            for tag, b in by_range.items():
                decode[f"h{h}_{kind}_{tag}"] = DecodeShape(h, b, kind)
    # The split counts by tile pairs below 15 CTAs (item 87): the compressed buckets of the
    # index widths 513-1024 (and 1-512 for h64 C4A) take b <= 7 / 14 rows; the 1-16-CTA
    # buckets they were cut from keep 15-16 CTAs (h64 b16, h128 b8)
    for h, b_new, b_old in ((64, 8, 16), (128, 4, 8)):
        for kind in ("c4a", "c128a"):
            decode[f"h{h}_{kind}_w1024_ctas1_14"] = DecodeShape(h, b_new, kind, extra_width=1024)
            decode[f"h{h}_{kind}_ctas1_16"] = DecodeShape(h, b_old, kind)
    decode["h64_c4a_w512_ctas1_13"] = DecodeShape(64, 8, "c4a", extra_width=512)
    # TP head counts on the tokens-in-M schedule: the rows of bench.tp_decode_shapes
    # (h8 in every CTA range, h16 / h32 at 1-16, 34-66 and >= 67 CTAs, h32 SWA at 17-33 (the
    # draft rows' range): items 51, 65, 74)
    for kind, width in (("swa", None), ("c4a", 512), ("c128a", 1024)):
        tp = {16: ("ctas1_16", "ctas34_66", "ctas67_up"),
              32: ("ctas1_16",) + (("ctas17_33",) if kind == "swa" else ())
              + ("ctas34_66", "ctas67_up"),
              8: ("ctas1_16", "ctas17_33", "ctas34_66", "ctas67_up")}
        for h, tags in tp.items():
            for tag in tags:
                b = {"ctas1_16": 8, "ctas17_33": 32, "ctas34_66": 64, "ctas67_up": 128}[tag]
                decode[f"h{h}_{kind}_{tag}"] = DecodeShape(h, b, kind, extra_width=width,
                                                           varying=kind == "c128a")
    decode["h32_c128a_w1024_ctas1_14"] = decode["h32_c128a_ctas1_16"]
    decode["h32_c128a_ctas1_16"] = DecodeShape(32, 16, "c128a", extra_width=1024, varying=True)
    # C128A at long context (index width >= 4096, per-row lengths): the persistent grid (item 53)
    for h in (64, 128):
        for tag, b in (("ctas1_16", 2), ("ctas17_up", 32)):
            decode[f"h{h}_c128a_long_{tag}"] = DecodeShape(h, b, "c128a", extra_width=8192,
                                                           varying=True)
    # TP head counts (V4-Pro TP8 = 16 heads, TP4 = 32), Flash C4A width
    prefill = {"h16_tp": PrefillShape(16, 4096, 640, 32768),
               "h32_tp": PrefillShape(32, 4096, 640, 32768)}
    for h in (64, 128):
        prefill[f"h{h}_topk1_256"] = PrefillShape(h, 4096, 128, 32768)
        prefill[f"h{h}_topk257_1024"] = PrefillShape(h, 4096, 640, 32768)
        prefill[f"h{h}_topk1025_4096"] = PrefillShape(h, 4096, 1152, 32768)
        prefill[f"h{h}_topk4097_up"] = PrefillShape(h, 1024, 8320, 65536)
    gather = {"rows1_16k": GatherShape(4, 2048), "rows16k_256k": GatherShape(4, 8319),
              "rows16k_128k": GatherShape(4, 8319), "rows128k_256k": GatherShape(4, 32768),
              "rows256k_up": GatherShape(4, 131072)}
    return {
        "sparse_decode": decode,
        "sparse_prefill": prefill,
        "dequant_gather": gather,
        "global_topk": {"all": GlobalTopkShape(256, 1024, 256, 64)},
        "combine_topk_swa": {"all": CombineShape((0, 3000, 20000, 100000), (2048,) * 4, 4,
                                                 1024, 1024)},
        "insert_k_cache": {"tokens1_512": InsertShape(128), "tokens512_up": InsertShape(8192)},
    }


SUITES: Dict[str, Callable[[], dict]] = {"dsv4": _dsv4_suite}
