"""train_tp.py: parallel layers equal their dense versions, training equals train_single.py, counted bytes and
parameters equal theory, activation memory shrinks as Korthikanti et al. predict."""
import os

import pytest
import torch
import torch.nn.functional as F

from distributed_helper import run_workers
from train_helpers import assert_same_losses, assert_same_weights, losses, run_single, tiny_argv


# ----------------------------------------------------------------------------------------------------------
# training parity with train_single.py

def _numpy(tensors):
    return {n: t.detach().cpu().numpy() for n, t in tensors.items()}   # tensors would travel as shared memory


def _train_worker(rank, world_size, argv):
    """Train; return the gathered full weights (rank 0) and this rank's replicated parameters."""
    import train_tp
    result = train_tp.main(argv)
    full = train_tp.gather_full_weights(result["model"], result["group"])
    replicated = {n: p for n, p in result["model"].named_parameters() if not hasattr(p, "tp_split")}
    return _numpy(full) if rank == 0 else None, _numpy(replicated)


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    return run_single(tiny_argv(tiny_data, out))


@pytest.mark.parametrize("tp,sp,overlap", [(2, False, False), (2, True, True), (4, False, True), (4, True, False)])
def test_tp_matches_single(tiny_data, tmp_path, single_run, tp, sp, overlap):
    ref_losses, ref_weights = single_run
    argv = tiny_argv(tiny_data, str(tmp_path), tp=tp, sp=sp) + (["--tp_overlap"] if overlap else [])
    results = run_workers(_train_worker, tp, args=(argv,))
    assert_same_losses(ref_losses, losses(str(tmp_path)))
    assert_same_weights(ref_weights, {n: torch.from_numpy(a) for n, a in results[0][0].items()})
