"""One long sequence split across processes: a few training steps of an attention layer with
linattn.torch.distributed, checked against the same steps in one process.

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py
    # several machines: on each, with its own --node-rank
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        examples/context_parallel.py --method favor --tokens 65536

Position-wise layers (the q/k/v/output projections here; MLPs, norms) run on each rank's block
as they are; only attention talks to the other ranks. The parameters are replicated, so each
rank's gradient is its share: all-reduce them with SUM before the optimizer step (as below)."""

import argparse
import math

import torch
import torch.distributed as dist

import linattn
import linattn.torch as lt
import linattn.torch.distributed as ld

ap = argparse.ArgumentParser()
ap.add_argument("--method", choices=["softmax", "elu", "favor"], default="favor")
ap.add_argument("--tokens", type=int, default=1024, help="length of the whole sequence")
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
linattn.set_num_threads(1)
E, H = 64, 4
torch.manual_seed(0)  # the same parameters and data on every rank
proj = torch.nn.Linear(E, 3 * E, dtype=torch.float64)
x_all = torch.randn(1, a.tokens, E, dtype=torch.float64)
target_all = torch.randn(1, a.tokens, E, dtype=torch.float64)
features = torch.from_numpy(linattn.random_features(128, E // H, seed=0)).double()


def attend(x, layer, module):
    """Causal attention of x [1, n, E] projected by layer, through module (linattn.torch or
    its distributed twin)."""
    q, k, v = (t.view(1, -1, H, E // H).transpose(1, 2) for t in layer(x).split(E, -1))
    extra = {"layout": "zigzag"} if module is ld else {}
    if a.method == "softmax":
        out = module.softmax_attention(q, k, v, causal=True, **extra)
    elif a.method == "elu":
        out = module.linear_attention(q, k, v, causal=True, **extra)
    else:
        out = module.favor_attention(q, k, v, features, causal=True, **extra)
    return out.transpose(1, 2).reshape(1, -1, E)


# This rank's tokens (zig-zag blocks, so that causal attention gives every rank the same work).
x = ld.shard(x_all.unsqueeze(1), layout="zigzag").squeeze(1)
target = ld.shard(target_all.unsqueeze(1), layout="zigzag").squeeze(1)
single = torch.nn.Linear(E, 3 * E, dtype=torch.float64)
single.load_state_dict(proj.state_dict())
opt = torch.optim.SGD(proj.parameters(), lr=0.1)
opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
for step in range(a.steps):
    loss = ((attend(x, proj, ld) - target) ** 2).sum() / a.tokens  # this rank's share of the mean
    opt.zero_grad()
    loss.backward()
    for p in proj.parameters():
        dist.all_reduce(p.grad)  # SUM: the shares make the whole sequence's gradient
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    # The same step in one process, on the whole sequence.
    loss_single = ((attend(x_all, single, lt) - target_all) ** 2).sum() / a.tokens
    opt_single.zero_grad()
    loss_single.backward()
    opt_single.step()
    if rank == 0:
        print("step %d: loss %.12f on %d ranks, %.12f in one process" % (step, float(total), world,
                                                                     float(loss_single)))
    assert math.isclose(float(total), float(loss_single), rel_tol=1e-10), (float(total), float(loss_single))
for p, s in zip(proj.parameters(), single.parameters()):
    assert torch.allclose(p, s, rtol=1e-10, atol=1e-12)
if rank == 0:
    print("the %d-rank parameters equal the one-process ones after %d steps" % (world, a.steps))
dist.destroy_process_group()
