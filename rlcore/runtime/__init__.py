"""rlcore.runtime"""
