"""The front end: the one way from a prompt and `SamplingParams` to the engine's requests (the n fan-out, each
sample's seed, the stop matcher, the length rule) and from its completions to text, logprobs and finish reasons.
The batch job, Serve and the Python API all go through it. Imports the engine and below."""
