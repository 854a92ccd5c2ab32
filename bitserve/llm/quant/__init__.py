"""Quantized layers: int8, int8 with outlier channels (LLM.int8()), int4, int8 embeddings.

This package is what a quantized model needs to load and run: its layers and how a
model's layers are swapped and saved. The engine's models load them (`llm/models`,
`llm/gguf.py`) and so does the hf backend for quantized encoders. The commands that
write and validate quantized folders, `bitserve quantize` and `bitserve eval`, are
`bitserve.quantize`, which builds on this package and on the engine; this package
imports neither (only `bitserve.kernels`), so the engine can load quantized models.

- `linear.py`: the quantized layers and which kernel runs at which batch size (the C
  GEMVs and the decode layer that reads them live in `bitserve/kernels`);
- `ggml.py`: a linear layer over llama.cpp's own blocks (GGUF Q4_K, Q8_0, ...; `llm/gguf.py`);
- `quantize.py`: swapping a model's layers, saving and loading quantized folders;
- `checkpoints.py`: AWQ and GPTQ folders (their `quantization_config`) on the int4 kernel;
- `encoder.py`: the same for transformers encoders (the hf backend).
"""
