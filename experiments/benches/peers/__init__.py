"""The side-by-side benchmark against PyTorch DDP and torchft.

This package owns :mod:`experiments.peer_bench`'s code: the main job's CNN
in PyTorch (:mod:`.torch_model`), the per-process torch trainer that DDP,
torchft and the torch compute floor run (:mod:`.torch_worker`, with its
torchft side in :mod:`.torchft_side`), the recovery runs
(:mod:`.recovery`), the allocator's pick for the link (:mod:`.auto`) and
the orchestration, summary and plot (:mod:`.bench`). torch and torchft are
imported lazily, only where a torch run needs them.
"""
