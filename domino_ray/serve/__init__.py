"""The Ray Serve edge: the Serve application, the OpenAI-style API, token streaming to text, metrics and health."""
