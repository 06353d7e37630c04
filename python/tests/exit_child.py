"""A process that uses linattn and then exits, for test_clean_exit.py: `python exit_child.py
SCENARIO [RANK WORLD STORE]`. It prints "ready to exit" as the last thing it does before the
interpreter exits; whatever happens after that is what the test checks (exit code 0, nothing
on stderr about terminate or BLAS).

Scenarios:
  numpy_daemon     daemon threads looping over forward, backward and decoding calls, several
                   linattn threads each, still inside a call when the main thread exits
  torch_loaded     the same with torch imported and linattn.torch's forward and backward run on
                   the main thread first (torch's own threads alive at exit). Daemon threads
                   running torch ops at exit are not among them: PyTorch's own GIL release
                   aborts those (6 of 6 runs of a plain matmul's backward; docs/pytorch.md)
  distributed      one rank of a 2-process gloo group (FileStore, no port): linattn.torch.distributed
                   forward and backward, an optimizer made after init_process_group (which
                   imports torch._dynamo), a daemon thread calling linattn meanwhile, its own
                   collectives last, destroy_process_group(), exit
  distributed_nodestroy  the same with linattn's collectives last and no destroy_process_group()

A long switch interval (sys.setswitchinterval) keeps gloo's worker threads from taking the GIL
until the main thread gives it up, which makes an exit race, if there is one, show up in most
runs rather than in a few percent."""
import sys
import threading

import numpy as np

import linattn


def daemon_calls(started):
    """Starts a daemon thread that calls linattn in a loop; sets started after its first call."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 2, 1500, 32)).astype(np.float32) for _ in range(4))

    def loop():
        state = linattn.recurrent_state(1, 2, 32, 32)
        while True:
            linattn.softmax_attention(q, k, v, causal=True)
            linattn.linear_attention_backward(q, k, v, g, causal=True)
            state.prefill(q, k, v)
            started.set()

    threading.Thread(target=loop, daemon=True).start()


def distributed(rank, world, store, destroy):
    import datetime

    import torch
    import torch.distributed as dist
    import linattn.torch.distributed as ld  # before init_process_group, as documented

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    sys.setswitchinterval(5.0)
    layer = torch.nn.Linear(8, 8, dtype=torch.float64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
    started = threading.Event()
    daemon_calls(started)
    x = torch.randn(1, 2, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    for causal in (False, True):
        q = layer(x)
        out = ld.softmax_attention(q, q, x, causal=causal, layout="zigzag")
        out = out + ld.linear_attention(q, q, x, causal=causal)
        out.sum().backward()
    if destroy:
        for p in layer.parameters():
            dist.all_reduce(p.grad)  # the user's own collectives come last
        opt.step()
        total = out.detach().sum().clone()
        dist.all_reduce(total)
    else:
        out = ld.linear_attention(q.detach(), q.detach(), x, causal=True)  # linattn's come last
    started.wait()
    if destroy:
        dist.destroy_process_group()


def main():
    scenario = sys.argv[1]
    linattn.set_num_threads(3)
    if scenario.startswith("distributed"):
        distributed(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], destroy=scenario == "distributed")
    else:
        if scenario == "torch_loaded":
            import torch
            import linattn.torch as lt
            q = torch.randn(1, 2, 300, 16, requires_grad=True)
            (lt.linear_attention(q, q, q, causal=True) + lt.softmax_attention(q, q, q)).sum().backward()
        started = threading.Event()
        for _ in range(2):
            daemon_calls(started)
        started.wait()
    print("ready to exit", flush=True)


if __name__ == "__main__":
    main()
