"""Export a checkpoint to ONNX graphs (encoder + one decoder step) and TensorRT engines."""
