"""callbacks"""
