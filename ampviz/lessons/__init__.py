"""The classroom: helpers the notebooks in ``lessons/`` use, one module per topic.

Each module holds its topic's computation, figure and widget together, and names the lessons that
use it. The classroom imports the practitioner core (``ampviz``, ``ampviz.plots``, ``ampviz.widgets``,
``ampviz.examples``); the core never imports the classroom, except through ``ampviz.examples.fixtures``, the one
place ``ampviz demo`` and the runnable examples take the classroom's data sets and models from
(``tests/test_layout.py`` checks both). Install it with ``pip install "ampviz[lessons]"``.

==================  =============================================================  ==========
module              topic                                                          lessons
==================  =============================================================  ==========
bits                sign / exponent / mantissa of a value; DtypeExplorer           01
spacing             the gap between neighbouring values, per binade                01, 08
throughput          matmul speed per dtype, measured                               02
memory              the bytes of one training step; MemoryExplorer                 02
comm                what DDP's all-reduce sends, per bucket                        02
autocast_ops        every aten op and its dtype under autocast; AutocastExplorer   03, 04, 04b, 07b
autocast_lists      autocast's op lists: the docs, the dispatcher, probes          03, 04
autocast_placement  backward and the optimizer step in or out of autocast; explorer 04
autocast_code       custom Functions (custom_fwd / custom_bwd); autocast in threads 04b
muon                Muon's Newton–Schulz products under autocast                   04 (appendix)
tables              HTML tables that keep every cell whole                         03, 04b
dataflow            the dtype on each arrow of one mixed-precision step            07b
rounding            weight updates and running sums rounded in a low format       07, 08
master_weights      UpdateExplorer; pure fp16 vs fp32-master training, drawn       07
underflow           captured gradients and the loss scales that save them          05, 06, 08
format_ranges       one histogram against fp16 / bf16 / fp8 side by side           08
fp8_scaling         fp8 casts per tensor / per row, judged by the GEMMs they feed  08b
clipping            clipping before or after unscale_; ClipOrderExplorer           09
sampler             what DistributedSampler hands each rank; SamplerExplorer       10, 11
exercises           predict-first checks for every lesson's exercises              01-13
data                small data sets that ship with scikit-learn and Python         01-13
models              small MLPs and transformers                                    02-12
launch              ranks run from a notebook (Workers, launch), as torchrun       10-11b
ddp_ranks           lesson 10's rank functions (process-group basics)              10-11b
==================  =============================================================  ==========
"""
