"""The models a deployment serves: the catalog (``models.toml``), token counting with each model's own
tokenizer, and the prompt framing that keeps client text out of the template's control tokens. The
edge, the workers and the processor all import it."""
