"""Building model repositories: the exporters, the slicer of ONNX models, what they share."""
