"""`bitserve quantize` and `bitserve eval`: calibrate, write quantized model folders,
and measure what quantization cost (the layers themselves are `bitserve.llm.quant`).

- `calibrate.py`: the activation profiler and the outlier report;
- `scoring.py`: running a model over windows of text (perplexity, calibration);
- `evaluate.py`: perplexity, agreement, cosine similarity, memory, speed;
- `folders.py`: where `bitserve quantize` reads and writes;
- `command.py`: `bitserve quantize` and `bitserve eval`.
"""
