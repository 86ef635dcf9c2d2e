"""Contracts shared by packages that do not import each other: the train batch's layout (between
the batch builder and the train step), the first failure among cooperating threads, and a
workdir's lock (between a run and the study driving it). Imports nothing else of the package."""
