"""Integrations with model code graphctl did not write: ``hf`` runs unchanged Hugging Face
transformers models on the ``paged`` family (needs ``pip install 'graphctl[transformers]'``)."""
