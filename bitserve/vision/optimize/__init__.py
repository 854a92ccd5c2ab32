"""`bitserve optimize`: make a slow detector faster, and measure what each speed-up costs.

- `techniques`: int8 static quantization (onnxruntime QDQ, calibrated on training
  images), structured channel pruning (torch-pruning) with a fine-tune, distillation
  into a narrower student, and the input resolution.
- `measure`: mAP@[.5:.95] and mAP@.5 (pycocotools), batch-1 p50/p95 latency, batch-8
  throughput and weights size, every variant timed in the same interleaved loop.
- `report`: the table, the speed-accuracy scatter with its Pareto front, the JSON.
- `run`: builds the variants, measures them and writes each as a model version.
"""
