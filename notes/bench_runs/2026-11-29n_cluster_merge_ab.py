"""scripts/bench_decode.py with the CUDA attention's cluster merge (one row's list parts as one
cluster of blocks, merged through distributed shared memory) forced off by ``--no-cluster``:
the A/B of kernel run AU. Every other argument goes to bench_decode.

    PYTHONPATH=. python3 notes/bench_runs/2026-11-29n_cluster_merge_ab.py [--no-cluster] ARGS
"""
import functools
import sys

sys.path.insert(0, "scripts")

if "--no-cluster" in sys.argv:
    sys.argv.remove("--no-cluster")
    from pallas_kernels import sparse_attend_cuda, sparse_decode_gpu
    sparse_decode_gpu.attend_page_lists_cuda = functools.partial(
        sparse_attend_cuda.attend_page_lists_cuda, cluster=False)

import bench_decode  # noqa: E402

bench_decode.main(sys.argv[1:])
