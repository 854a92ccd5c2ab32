"""The protocols apart from any transport: the error vocabulary (errors.py) and the
OpenAI API's schemas and bodies (openai.py).

The server's front-ends (`bitserve.server`: HTTP, gRPC) and batch jobs
(`bitserve.offline`) both build on these, so a batch output line is exactly what the
server answers; nothing here knows HTTP or gRPC.
"""
