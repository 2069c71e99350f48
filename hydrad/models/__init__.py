"""Model families, the checkpoint loader and the offline checkpoint builder.

Importing the package is cheap: torch and transformers load with the submodule that needs them.
"""
