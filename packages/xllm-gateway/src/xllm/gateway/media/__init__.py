"""Image inputs at the OpenAI front (issue 47, "The API"): ``image_url`` content parts checked and
located (:mod:`.parts`), ``data:`` URLs and allow-listed ``http(s)`` URLs fetched within limits
(:mod:`.fetch`, :mod:`.limits`), decoded safely and hashed by content (:mod:`.images`), and the
model's image processor run on them (:mod:`.preprocess`), and handed to the engine (:mod:`.intake`, used by
the chat route). Every bad input is a 400 naming its field.

Import the submodules themselves: this package module imports nothing, so the ``xllm serve`` flag
parser (which reads :mod:`.limits`) loads neither Pillow nor transformers."""
