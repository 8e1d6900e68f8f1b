"""Exporting graphopt-transformed models: ONNX (:func:`graphopt.export.onnx.export_onnx`)."""
