"""Architecture names (config.json `architectures`) that more than the model code needs to know, kept
free of imports so the io layer can read them without loading any model (rollout_cli.models.registry
maps the names to classes)."""

# checkpoints that take images: their HF classes hold a vision tower (models/vision_language.py)
MULTIMODAL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
