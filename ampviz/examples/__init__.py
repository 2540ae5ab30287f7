"""Runnable examples, and the functions lessons run in several processes (they must be importable).

    torchrun --nproc-per-node 2 -m ampviz.examples.ddp_amp --out runs/ddp     # DDP + AMP, recorded
    torchrun --nproc-per-node 2 -m ampviz.examples.ddp_basics                 # process-group basics

``ddp_amp`` trains with DDP + AMP + gradient accumulation and records every rank; ``trainer`` holds
its Trainer (``evaluation`` its evaluation methods); ``ddp_basics`` holds the small rank functions of
lessons 10 and 10b.
"""
