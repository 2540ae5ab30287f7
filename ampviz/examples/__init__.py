"""Runnable programs, and what they need::

    torchrun --nproc-per-node 2 -m ampviz.examples.ddp_amp --out runs/ddp     # DDP + AMP, recorded

``ddp_amp`` trains with DDP + AMP + gradient accumulation and records every rank; ``trainer`` holds
its Trainer (``evaluation`` its evaluation methods); ``process_group`` joins the process group from
torchrun's environment. ``fixtures`` is the one place the practitioner side (these programs and
``ampviz demo``) takes the classroom's data sets and models from (``ampviz.lessons.data``,
``ampviz.lessons.models``). The notebook launcher and lesson 10's rank functions are the classroom's:
``ampviz.lessons.launch`` and ``ampviz.lessons.ddp_ranks`` (``torchrun --nproc-per-node 2 -m
ampviz.lessons.ddp_ranks`` runs the process-group basics).
"""
