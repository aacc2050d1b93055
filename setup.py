"""Maps the folder layout onto import names: core/ is `deepinfer`, plugins/ is `deepinfer_plugins`.

Everything else about the distribution is in pyproject.toml.
"""
from setuptools import find_packages, setup

PACKAGE_ROOTS = {"deepinfer": "core", "deepinfer_plugins": "plugins"}


def _packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(), package_dir=PACKAGE_ROOTS)
