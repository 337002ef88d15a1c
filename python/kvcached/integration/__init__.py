"""Integrations of kvcached into serving engines (one subpackage per engine)."""
