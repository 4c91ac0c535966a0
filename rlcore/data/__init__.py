"""rlcore.data"""
