"""Weight formats for one-token decode steps on CPU: the memory layout of the linear layers, int8
and fp16 weights, their products (inductor reductions and sfi's AVX2 int8 kernel) and the
``weights="auto"`` choice."""
