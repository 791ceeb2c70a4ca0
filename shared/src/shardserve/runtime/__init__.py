"""Running a rank's slice: the stage program interpreter, its ONNX segments and their compile cache."""
