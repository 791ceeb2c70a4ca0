"""Building model repositories: the exporters, the slicer of existing ONNX models, and what they share."""
