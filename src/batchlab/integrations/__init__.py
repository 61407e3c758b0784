"""Callbacks that watch training you run with a framework, and write an observed record to the notebook.

    from batchlab.integrations.transformers import BatchlabCallback   # Hugging Face Trainer
    from batchlab.integrations.lightning import BatchlabCallback      # Lightning Trainer

Each module imports only its own framework (pip install 'batchlab[hf]' or 'batchlab[lightning]').
"""
