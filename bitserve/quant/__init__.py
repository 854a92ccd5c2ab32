"""Quantization: int8, int8 with outlier channels (LLM.int8()), int4; calibration; eval.

- `linear.py`: the quantized layers and their kernels;
- `quantize.py`: swapping a model's layers, saving and loading quantized folders;
- `calibrate.py`: the activation profiler and the outlier report;
- `encoder.py`: the same for transformers encoders (the hf backend);
- `evaluate.py`: perplexity, agreement, cosine similarity, memory, speed;
- `folders.py`: where `bitserve quantize` reads and writes;
- `command.py`: `bitserve quantize` and `bitserve eval`.
"""
