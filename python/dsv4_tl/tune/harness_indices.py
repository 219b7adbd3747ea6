"""Tuning harnesses of the index helpers (global top-k, combine top-k + window): bit-exact
checks on outputs poisoned with -7."""

from ..kernels import COMBINE_TOPK_SWA as COMBINE_SPEC
from ..kernels import GLOBAL_TOPK as GLOBAL_SPEC
from ..kernels import KernelSpec
from .harness import OpHarness, assert_same


def _index_harness(spec: KernelSpec, inputs, reference, call, name: str) -> OpHarness:
    """An index op's harness: the dense front end (no bucket features); the check calls
    ``call(x, out=, lens=)`` into outputs poisoned with -7 (no valid index or length) and
    compares both exactly with the reference's ``(indices, lens)``."""

    def check(x: dict, ref, device) -> None:
        import torch

        out = torch.full(ref[0].shape, -7, dtype=torch.int32, device=device)
        lens = torch.full(ref[1].shape, -7, dtype=torch.int32, device=device)
        call(x, out=out, lens=lens)()
        torch.cuda.synchronize()
        assert_same(name, out, ref[0])
        assert_same("lens", lens, ref[1])

    return OpHarness(spec=spec, describe=lambda rep: {}, inputs=inputs, reference=reference,
                     check=check, call=call)


def _global_inputs(rep, gen, sets: int, device) -> list:
    import torch

    out = []
    for _ in range(sets):
        nb = rep.reqs * rep.max_blocks + 4
        bt = torch.randperm(nb, generator=gen, device=device)[: rep.reqs * rep.max_blocks]
        local = torch.randint(0, rep.max_blocks * rep.block_size, (rep.tokens, rep.k),
                              generator=gen, device=device, dtype=torch.int32)
        n_valid = torch.randint(rep.k // 2, rep.k + 1, (rep.tokens, 1), generator=gen,
                                device=device)
        local[torch.arange(rep.k, device=device)[None] >= n_valid] = -1
        out.append({"topk_indices": local,
                    "token_to_req": torch.arange(rep.tokens, device=device, dtype=torch.int32) % rep.reqs,
                    "block_table": bt.view(rep.reqs, rep.max_blocks).int(),
                    "block_size": rep.block_size,
                    "is_valid_token": torch.ones(rep.tokens, dtype=torch.bool, device=device)})
    return out


def _global_reference(x: dict, device):
    from ..reference import compute_global_topk_indices_and_lens_ref

    return compute_global_topk_indices_and_lens_ref(
        x["topk_indices"], x["token_to_req"], x["block_table"], x["block_size"],
        x["is_valid_token"])


def _global_call(x: dict, **outputs):
    from ..ops import compute_global_topk_indices_and_lens

    return lambda: compute_global_topk_indices_and_lens(
        x["topk_indices"], x["token_to_req"], x["block_table"], x["block_size"],
        x["is_valid_token"], **outputs)


GLOBAL_TOPK = _index_harness(GLOBAL_SPEC, _global_inputs, _global_reference, _global_call,
                             "global")


def _combine_inputs(rep, gen, sets: int, device) -> list:
    import torch

    prefix = torch.tensor(rep.prefix, dtype=torch.int64)
    q_len = torch.tensor(rep.q_len, dtype=torch.int64)
    seq = prefix + q_len
    gather = q_len + torch.minimum(prefix, torch.tensor(rep.window - 1))
    n = int((seq // rep.compress_ratio).max())
    m = n + int(gather.max())
    qsl = torch.zeros(len(rep.q_len) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_len, 0)
    cap = int(seq.max()) // rep.compress_ratio + 1
    return [{"args": (torch.randint(0, cap, (int(q_len.sum()), rep.k), generator=gen,
                                    device=device, dtype=torch.int32),
                      qsl.int().to(device), seq.int().to(device), gather.int().to(device),
                      rep.window, rep.compress_ratio, rep.topk, m, n)}
            for _ in range(sets)]


def _combine_reference(x: dict, device):
    from ..reference import combine_topk_swa_indices_ref

    return combine_topk_swa_indices_ref(*x["args"])


def _combine_call(x: dict, **outputs):
    from ..ops import combine_topk_swa_indices

    return lambda: combine_topk_swa_indices(*x["args"], **outputs)


COMBINE_TOPK_SWA = _index_harness(COMBINE_SPEC, _combine_inputs, _combine_reference,
                                  _combine_call, "combined")
