"""Pieces several methods share: input and option checks, masked softmax, the modified
Nystrom core (and its naive form), the exact part on angular-LSH blocks."""
