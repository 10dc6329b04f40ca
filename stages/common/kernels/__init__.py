"""spa's own kernels for the parts of a model's forward its time goes to, most of them for a CPU.

* `linear`: the linear layers as oneDNN products instead of PyTorch's BLAS, for generation (on
  weights reordered once) and for training (forward and backward).
* `attention`: the attention function spa registers with transformers as "sdpa" (`spa_sdpa`) and
  the kernels it calls: prefix-tree-packed rows, a decode step's grouped heads without a KV copy,
  the columns every row shares read once for all rows, a prefill over cached keys as oneDNN
  products.
* `native`: the attention over a KV cache, a decode step's or a prefill's, as one C kernel (scores,
  softmax and the values' sum in one pass, float32 arithmetic over a float32 or bfloat16 cache),
  and a decode step's sampling from its logits, in C compiled on first use with the machine's C
  compiler, for x86 CPUs with AVX2.
* `decode`: a decode step of a Llama-family model as one loop over its layers on its own weights,
  with fewer operators and none of transformers' per-module machinery (the hf backend's, on a CPU).

Each gives what PyTorch's or transformers' own kernel gives, up to rounding, and applies only
where it can run (a CPU, PyTorch built with oneDNN, a C compiler, the dtypes it handles);
elsewhere the stock kernel runs. Loading a model (`stages.common.models.load_model`) registers `spa_sdpa`.
"""
