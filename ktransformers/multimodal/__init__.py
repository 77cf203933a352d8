"""Images in, text out: decoding and limits of user images (:mod:`.images`) and the model's own
transformers processor turning a chat with images into model inputs (:mod:`.processor`).

The vision tower runs inside the model's own forward at prefill (``pixel_values``,
``image_grid_thw``); decode steps are text only.  See docs/multimodal.md.
"""
