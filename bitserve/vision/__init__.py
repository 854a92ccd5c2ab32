"""Object detection: a CenterNet-style detector, its synthetic data, mAP, and serving.

- `data`: the seeded synthetic set (scikit-learn's 8x8 digits pasted on cluttered
  128x128 canvases) with COCO-style annotations.
- `net`: the detector (heatmap + size + offset heads: no NMS, no torchvision), its
  training loss, and the ONNX export whose graph also resizes the image and picks peaks.
- `evaluate`: mAP@[.5:.95] and mAP@.5 with pycocotools' COCOeval.
- `backend`: the `detector` backend that serves an exported graph through v2.
- `optimize/`: `bitserve optimize`, faster variants of the detector measured against mAP.
"""
