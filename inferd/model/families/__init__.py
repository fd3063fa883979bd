"""Model families: what each architecture's config and tensor names mean, and the ModelConfig they fill."""
