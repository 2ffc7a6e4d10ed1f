"""The Ray Data edge: the batch job, the Ray Data stage (processor, predictor, text stages), the output schema,
storage IO, pre-flight checks and the job summary."""
