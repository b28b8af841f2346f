"""Test support for the xLLM suites (see the package README); import the module you need."""
