"""DeepSeek-V4 attention layers end to end with dsv4-tl alone, as an inference engine runs them.

    python examples/dsv4_attention.py --device cuda          # full size (V4-Flash-like), CUDA
    python examples/dsv4_attention.py --device sycl-cpu      # small, Intel's SYCL CPU device
                                                             # (after bash scripts/setup_sycl.sh)

A V4-Flash-like model slice: 64 query heads, window 128, one layer of each type -- SWA-only,
C4A (compress ratio 4, top-k 512) and C128A (ratio 128, every visible entry) -- with random
per-token q and kv, a stand-in compressor (mean of each 4 / 128 native tokens) and a
stand-in indexer (top-k entries by score of the head-mean query against the compressed
keys). Caches use the real fp8_ds_mla layouts and block sizes (SWA 64, C4A 64, C128A 2) with
scattered block tables. It runs, with the dsv4-tl ops only (``dsv4_tl.ops``):

1. a prefill chunk of 4 requests with different prefixes (already cached by earlier chunks)
   and prompt lengths: ``insert_k_cache`` into the SWA and compressed caches,
   ``dequantize_and_gather_k_cache`` into the BF16 workspace, ``combine_topk_swa_indices``,
   ``sparse_prefill``;
2. 16 decode steps (one token per request, growing lengths): ``insert_k_cache`` of the new
   token (and of a compressed entry when one completes: slot -1 otherwise), the SWA slots,
   ``compute_global_topk_indices_and_lens`` for the compressed scope, ``sparse_decode`` over
   SWA + compressed scopes. On CUDA the step (all three layers) is captured once as a CUDA
   graph and replayed for the last half of the steps;
3. a check of every output against a dense float32 attention over the dequantised caches
   whose mask comes straight from spec §5's visibility rules (native token p visible from
   position i iff i - window < p <= i; compressed entry j iff i >= ratio·j + ratio - 1, and,
   for C4A, j among the indexer's picks), not from the index helpers.

Prints per phase the max error and the time; exits 1 on a mismatch.
"""

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

HEAD_DIM = 512
SWA_BS = 64  # SWA cache block size (vLLM: 64)
FP8_FORMAT = "e4m3fn"


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int = 64
    window: int = 128
    topk: int = 512  # C4A indexer top-k (V4-Flash)
    prefixes: tuple = (0, 1500, 5000, 9000)  # tokens cached before this chunk
    prompt: tuple = (700, 1024, 300, 2100)  # tokens of each request in this chunk
    steps: int = 16  # decode steps
    max_model_len: int = 16384

    @classmethod
    def small(cls):  # SYCL CPU device / CI: same structure, a few hundred tokens
        return cls(heads=8, window=32, topk=16, prefixes=(0, 40, 130, 300), prompt=(23, 64, 5, 80),
                   max_model_len=512)


# layer name -> (compress ratio, block size of its compressed cache); ratio 1 = SWA-only
LAYERS = {"swa": (1, None), "c4a": (4, 64), "c128a": (128, 2)}


def _now(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class Layer:
    """One attention layer: its caches, block tables, the model's random q / kv, the sink."""

    def __init__(self, name, cfg, device, gen):
        from dsv4_tl.cache_format import alloc_k_cache

        self.name, self.cfg = name, cfg
        self.ratio, self.cbs = LAYERS[name]
        R, L = len(cfg.prefixes), cfg.max_model_len
        self.kv = torch.randn(R, L, HEAD_DIM, generator=gen, device=device).bfloat16()
        self.sink = torch.rand(cfg.heads, generator=gen, device=device) * 2 - 1
        self.swa_cache, self.swa_bt = self._paged(R, L, SWA_BS, gen, device, alloc_k_cache)
        self.comp_cache = None
        if self.ratio > 1:
            n = L // self.ratio
            self.comp_cache, self.comp_bt = self._paged(R, n, self.cbs, gen, device, alloc_k_cache)
            # the indexer's keys (bf16), plus a scratch column n for rows that complete nothing
            self.comp_keys = torch.zeros(R, n + 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
            # C4A: indexer top-k; C128A: every visible entry, width padded to 128 (vLLM)
            self.width = cfg.topk if self.ratio == 4 else -(-n // 128) * 128

    @staticmethod
    def _paged(R, tokens, bs, gen, device, alloc):
        per = -(-tokens // bs)
        cache = alloc(R * per + 3, bs, device=device)
        bt = torch.randperm(R * per + 3, generator=gen, device=device)[: R * per]
        return cache, bt.view(R, per).int()

    def slots(self, bt, bs, req, pos):
        """Global slots of request-local positions (``req``, ``pos``: int64 tensors)."""
        return bt[req, pos // bs].long() * bs + pos % bs

    def compress(self, req, j):
        """Stand-in compressor: entry j of request req = mean of native tokens [ratio·j, ratio·j + ratio)."""
        pos = j[:, None] * self.ratio + torch.arange(self.ratio, device=j.device)
        return self.kv[req[:, None], pos].float().mean(1).bfloat16()

    def indexer(self, q, req, pos):
        """Stand-in indexer: [T, topk] request-local entries, best score first, -1 past the
        visible count (so valid entries form a prefix, as the index helpers assume)."""
        n_vis = (pos + 1) // self.ratio
        qm = q.float().mean(1)
        if len(req) > self.comp_keys.shape[0]:  # a prefill chunk (tokens grouped by request)
            scores = torch.cat([qm[req == r] @ self.comp_keys[r].float().T
                                for r in range(self.comp_keys.shape[0])])
        else:  # a decode step, one token per request
            scores = torch.einsum("td,tnd->tn", qm, self.comp_keys[req].float())
        cols = torch.arange(scores.shape[1], device=q.device)
        scores = scores.masked_fill(cols[None] >= n_vis[:, None], -math.inf)
        k = min(self.width, scores.shape[1])
        top = torch.topk(scores, k, dim=1)
        local = torch.where(top.values > -math.inf, top.indices, -1).int()
        if k < self.width:
            local = torch.nn.functional.pad(local, (0, self.width - k), value=-1)
        return local

    def local_rows(self, pos):
        """C128A rows: every visible entry ``0 .. (pos + 1) // 128 - 1``, then -1."""
        cols = torch.arange(self.width, device=pos.device)
        n_vis = ((pos + 1) // self.ratio)[:, None]
        return torch.where(cols[None] < n_vis, cols[None], -1).int()

    def insert(self, req, pos):
        """Write native tokens (req, pos) into the SWA cache and the compressed entries they
        complete into the compressed cache: slot -1 for tokens that complete none."""
        import dsv4_tl.ops as ops

        ops.insert_k_cache(self.swa_cache, self.kv[req, pos], self.slots(self.swa_bt, SWA_BS, req, pos),
                           FP8_FORMAT)
        if self.ratio > 1:
            done = (pos + 1) % self.ratio == 0
            j = torch.clamp((pos + 1) // self.ratio - 1, min=0)
            kc = self.compress(req, j)
            self.comp_keys[req, torch.where(done, j, self.comp_keys.shape[1] - 1)] = kc
            slot = torch.where(done, self.slots(self.comp_bt, self.cbs, req, j), -1)
            ops.insert_k_cache(self.comp_cache, kc, slot, FP8_FORMAT)


def prefill(layer, q, req, pos, seq, prompt, cfg):
    """The chunk of one layer: insert, gather into the workspace, combine indices, attend."""
    import dsv4_tl.ops as ops

    dev = q.device
    layer.insert(req, pos)
    gather = prompt + torch.clamp(seq - prompt, max=cfg.window - 1)  # query + min(prefix, W-1)
    N = int((seq // layer.ratio).max()) if layer.ratio > 1 else 0
    M = N + int(gather.max())
    ws = torch.full((len(seq), M, HEAD_DIM), math.nan, dtype=torch.bfloat16, device=dev)
    if layer.ratio > 1:
        ops.dequantize_and_gather_k_cache(ws, layer.comp_cache, (seq // layer.ratio).int(), None,
                                          layer.comp_bt, layer.cbs, 0, FP8_FORMAT)
        topk_idx = layer.indexer(q, req, pos) if layer.ratio == 4 else layer.local_rows(pos)
        topk = layer.width
    else:
        topk_idx, topk = torch.empty((len(pos), 0), dtype=torch.int32, device=dev), 0
    ops.dequantize_and_gather_k_cache(ws, layer.swa_cache, seq.int(), gather.int(), layer.swa_bt,
                                      SWA_BS, N, FP8_FORMAT)
    qsl = torch.nn.functional.pad(torch.cumsum(prompt, 0), (1, 0)).int()
    combined, lens = ops.combine_topk_swa_indices(topk_idx, qsl, seq.int(), gather.int(), cfg.window,
                                                  layer.ratio, topk, M, N)
    out, _, _ = ops.sparse_prefill(q, ws.view(-1, 1, HEAD_DIM), combined.unsqueeze(1),
                                   HEAD_DIM ** -0.5, layer.sink, lens)
    picks = topk_idx if layer.ratio == 4 else None
    return out, picks


class DecodeStep:
    """One decode step of every layer over static buffers (so that it can be captured)."""

    def __init__(self, layers, cfg, device):
        R = len(cfg.prefixes)
        self.layers, self.cfg = layers, cfg
        self.req = torch.arange(R, device=device)
        self.pos = torch.zeros(R, dtype=torch.int64, device=device)  # position of the new token
        self.q = {n: torch.zeros(R, 1, cfg.heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
                  for n in layers}
        self.out = {n: torch.zeros(R, 1, cfg.heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
                    for n in layers}
        self.lse = {n: torch.zeros(R, cfg.heads, 1, device=device) for n in layers}
        self.picks = {n: torch.zeros(R, l.width, dtype=torch.int32, device=device)
                      for n, l in layers.items() if l.ratio == 4}
        self.valid = torch.ones(R, dtype=torch.bool, device=device)

    def __call__(self):
        import dsv4_tl.ops as ops

        W = self.cfg.window
        for name, layer in self.layers.items():
            layer.insert(self.req, self.pos)
            # SWA scope: positions max(pos - W + 1, 0) .. pos ascending, then -1
            p = torch.clamp(self.pos - W + 1, min=0)[:, None] + torch.arange(W, device=self.pos.device)
            ok = p <= self.pos[:, None]
            p = torch.minimum(p, self.pos[:, None])  # (positions past pos are not read)
            swa = torch.where(ok, layer.slots(layer.swa_bt, SWA_BS, self.req[:, None], p), -1).int()
            swa_len = torch.clamp(self.pos + 1, max=W).int()
            extra = {}
            if layer.ratio > 1:
                q = self.q[name][:, 0]
                local = (layer.indexer(q, self.req, self.pos) if layer.ratio == 4
                         else layer.local_rows(self.pos))
                if layer.ratio == 4:
                    self.picks[name].copy_(local)
                g, g_len = ops.compute_global_topk_indices_and_lens(
                    local, self.req.int(), layer.comp_bt, layer.cbs, self.valid)
                extra = dict(extra_k_cache=layer.comp_cache, extra_indices=g.unsqueeze(1),
                             extra_topk_length=g_len)
            ops.sparse_decode(self.q[name], layer.swa_cache, swa.unsqueeze(1), swa_len,
                              HEAD_DIM ** -0.5, layer.sink, fp8_format=FP8_FORMAT,
                              out=self.out[name], lse=self.lse[name], **extra)


# ----------------------------------------------------------------------------- the check
def dense_reference(layer, q, req, pos, picks, cfg):
    """float32 attention of queries q [T, H, 512] at (req, pos) over the dequantised caches,
    masked by spec §5's visibility rules; picks: C4A indexer rows [T, topk] (request-local)."""
    from dsv4_tl.cache_format import dequantize_k

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    kmax = 0.0
    for r in req.unique().tolist():
        rows = (req == r).nonzero().view(-1)
        L = int(pos[rows].max()) + 1
        p = torch.arange(L, device=q.device)
        keys = [dequantize_k(layer.swa_cache, layer.slots(layer.swa_bt, SWA_BS, torch.full_like(p, r), p),
                             FP8_FORMAT)]
        n = L // layer.ratio if layer.ratio > 1 else 0
        if n:
            j = torch.arange(n, device=q.device)
            keys.append(dequantize_k(layer.comp_cache,
                                     layer.slots(layer.comp_bt, layer.cbs, torch.full_like(j, r), j),
                                     FP8_FORMAT))
        K = torch.cat(keys)
        kmax = max(kmax, float(K.abs().max()))
        for chunk in rows.split(64):
            i = pos[chunk][:, None]
            mask = (p[None] <= i) & (p[None] > i - cfg.window)  # causal window
            if n:
                vis = i >= layer.ratio * j[None] + layer.ratio - 1
                if picks is not None:  # C4A: and picked by the indexer
                    picked = torch.zeros(len(chunk), n + 1, dtype=torch.bool, device=q.device)
                    sel = picks[chunk].long()
                    picked.scatter_(1, torch.where(sel >= 0, sel, n), True)
                    vis &= picked[:, :n]
                mask = torch.cat([mask, vis], 1)
            s = torch.einsum("thd,kd->thk", q[chunk].float(), K) * HEAD_DIM ** -0.5
            s = s.masked_fill(~mask[:, None], -math.inf)
            m = torch.maximum(s.amax(-1, keepdim=True), layer.sink.view(1, -1, 1))
            e = torch.exp(s - m)
            denom = e.sum(-1, keepdim=True) + torch.exp(layer.sink.view(1, -1, 1) - m)
            out[chunk] = torch.einsum("thk,kd->thd", e / denom, K)
    return out, kmax


def compare(got, ref, kmax):
    """(max |err|, ok): tolerance of the attention kernels (dsv4_tl.testing.check_attention)."""
    from dsv4_tl.testing import out_abs_tol

    err = (got.float() - ref).abs()
    ok = bool((err <= out_abs_tol(kmax) + 2 / 128 * ref.abs()).all()) and not got.isnan().any()
    return float(err.max()), ok


# ----------------------------------------------------------------------------- main
def run(device: str = "cuda", small: bool = False, seed: int = 0, say=print) -> tuple:
    """Run the three phases and the check. Returns ``(ok, rows)``: ok when every output
    matches; rows ``(phase, layer, max error, ok, seconds per call)``."""
    if device == "sycl-cpu":
        os.environ.setdefault("DSV4_TL_SYCL_DEVICE", "opencl:cpu")
        device = "cpu"
    dev = torch.device(device)
    cfg = Config.small() if small else Config()
    gen = torch.Generator(dev).manual_seed(seed)
    layers = {name: Layer(name, cfg, dev, gen) for name in LAYERS}
    R = len(cfg.prefixes)
    prefixes = torch.tensor(cfg.prefixes, device=dev)
    prompt = torch.tensor(cfg.prompt, device=dev)
    seq = prefixes + prompt
    rows = []  # (phase, layer, max err, ok, seconds)

    # Earlier chunks: the prefixes are in the caches already (time includes kernel loading).
    t = _now(dev)
    req = torch.repeat_interleave(torch.arange(R, device=dev), prefixes)
    pos = torch.cat([torch.arange(n, device=dev) for n in cfg.prefixes])
    for layer in layers.values():
        layer.insert(req, pos)
    rows.append(("prefix inserts", "all", None, True, _now(dev) - t))

    # 1. The prefill chunk. Each call runs twice, the second timed: the first loads (or
    # JIT-compiles) the kernels; both compute the same (inserting a row twice is idempotent).
    req = torch.repeat_interleave(torch.arange(R, device=dev), prompt)
    pos = torch.cat([torch.arange(a, b, device=dev) for a, b in zip(cfg.prefixes, seq.tolist())])
    results = {}
    for name, layer in layers.items():
        q = torch.randn(len(pos), cfg.heads, HEAD_DIM, generator=gen, device=dev).bfloat16()
        prefill(layer, q, req, pos, seq, prompt, cfg)
        t = _now(dev)
        out, picks = prefill(layer, q, req, pos, seq, prompt, cfg)
        results[name] = [("prefill", q, req, pos, picks, out, _now(dev) - t)]

    # 2. Decode steps (step 0 once more first, untimed: kernel loading); on CUDA the second
    # half replays one captured step.
    step = DecodeStep(layers, cfg, dev)
    graph = None
    for s in range(-1, cfg.steps):
        replay = dev.type == "cuda" and s >= cfg.steps // 2
        step.pos.copy_(seq + max(s, 0))
        for name in layers:
            step.q[name].copy_(torch.randn(step.q[name].shape, generator=gen, device=dev))
        if replay and graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        t = _now(dev)
        graph.replay() if replay else step()
        dt = _now(dev) - t
        if s < 0:
            continue
        for name, layer in layers.items():
            picks = step.picks[name].clone() if name in step.picks else None
            results[name].append(("decode graph" if replay else "decode", step.q[name][:, 0].clone(),
                                  step.req.clone(), step.pos.clone(), picks,
                                  step.out[name][:, 0].clone(), dt))

    # 3. The check against the dense reference.
    for name, layer in layers.items():
        by_phase = {}
        for phase, q, rq, ps, picks, out, dt in results[name]:
            ref, kmax = dense_reference(layer, q, rq, ps, picks, cfg)
            err, ok = compare(out, ref, kmax)
            e0, ok0, t0, n0 = by_phase.get(phase, (0.0, True, 0.0, 0))
            by_phase[phase] = (max(e0, err), ok0 and ok, t0 + dt, n0 + 1)
        for phase, (err, ok, dt, n) in by_phase.items():
            rows.append((phase if n == 1 else f"{phase} x{n}", name, err, ok, dt / n))

    where = "the SYCL CPU device" if dev.type == "cpu" else str(dev)
    say(f"dsv4-tl DSv4 attention, {'small' if small else 'full'} size on {where}: {cfg.heads} heads, "
        f"window {cfg.window}, C4A top-k {cfg.topk}, prefixes {cfg.prefixes}, prompts {cfg.prompt}, "
        f"{cfg.steps} decode steps")
    say(f"{'phase':18s} {'layer':6s} {'max err':>10s} {'check':>6s} {'ms/call':>9s}")
    for phase, name, err, ok, dt in rows:
        e = "" if err is None else f"{err:.3e}"
        say(f"{phase:18s} {name:6s} {e:>10s} {'ok' if ok else 'FAIL':>6s} {dt * 1e3:9.3f}")
    say("(decode: one step of all three layers per call; times are wall clock, synchronised)")
    all_ok = all(ok for *_, ok, _ in rows)
    say("all outputs match the dense reference" if all_ok else "MISMATCH against the dense reference")
    return all_ok, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "sycl-cpu"],
                        help="cuda (full size by default) or sycl-cpu (Intel's SYCL CPU device; small)")
    parser.add_argument("--size", choices=["full", "small"], default=None,
                        help="default: full on cuda, small on sycl-cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    small = (args.size or ("full" if args.device == "cuda" else "small")) == "small"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device sycl-cpu", file=sys.stderr)
        return 2
    ok, _ = run(args.device, small, args.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
